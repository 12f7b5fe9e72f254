"""One training run of the tiny model: its options, models, optimizer and data stream
(`Training.step()` trains on one batch), its loss log, and saving it as a checkpoint in the
release layout with a manifest (a complete checkpoint at every save)."""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import logging
import os
import shutil
import tarfile
import time
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.tiny.checkpoint import write_trained_checkpoint
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.manifest import write_manifest
from tools.tiny_batches import BatchStream, make_batch, plan_shape, sample_maker
from tools.tiny_data import RECIPE_VERSION, RECIPES
from tools.tiny_graph_step import GraphStep
from tools.tiny_quant import PARAMETRIZED, fake_fp8, quantization_gap
from tools.tiny_train_ops import training_ops
from tools.tiny_trainer import (
    INDEXER_LOSS_WEIGHT,
    MTP_LOSS_WEIGHT,
    StepTensors,
    balance_routers,
    build_models,
    forward_losses,
    lr_at,
    moe_layers,
    step_losses,
    step_tensors,
)

logger = logging.getLogger("glmflash.train_tiny")
VARIANT = "trained"
LOG_COLUMNS = ("step", "loss", "mtp_loss", "indexer_loss", "trained_tokens", "seconds")
SYNC_EVERY = 5  # steps between reads of the losses (each read waits for the device)
PROBE_TOKENS = 1024  # the fp32 forward recorded before training, replayed by the tests
GAP_SEED_OFFSET = 1_000_003  # the data stream of the FP8 rounding measure (not a training one)


@dataclasses.dataclass(frozen=True)
class RunOptions:
    seed: int = 0
    tokens_per_step: int = 2048
    peak_lr: float = 3e-3
    warmup_steps: int = 30
    device: str = "cpu"
    amp: str = "fp32"
    compile: bool = False
    workers: int = 0
    threads: int = 1
    qat_fraction: float = 0.0
    """The last part of the steps that trains through FP8-rounded weights (tiny_quant.py)."""
    recipe: int = RECIPE_VERSION
    """The training data's recipe (tiny_data.RECIPES)."""
    graph: bool = False
    """Batches of one planned shape, each step replayed as a CUDA graph (tiny_graph_step.py;
    on a CPU: the same fixed buffers, eagerly)."""
    gap_tokens: int = 8192
    """Tokens of the batch on which the cost of FP8 rounding is measured at the end."""


class Training:
    """The models, optimizer and data stream of one run; `step()` trains on one batch."""

    def __init__(self, options: RunOptions, total_steps: int) -> None:
        self.options, self.total_steps, self.num_steps = options, total_steps, 0
        torch.manual_seed(options.seed)
        self.config_dict = tiny_config(VARIANT)
        self.device = torch.device(options.device)
        self.config = ModelConfig.from_dict(self.config_dict)
        self.is_qat = False
        model, mtp = build_models(self.config, options.seed)
        self.probe = probe_losses(model, mtp, self.config_dict, options.seed, options.recipe)
        self.model, self.mtp = model.to(self.device), mtp.to(self.device)
        self.params = [p for m in (self.model, self.mtp) for p in m.parameters()
                       if p.requires_grad]
        on_gpu = self.device.type == "cuda"
        # A captured optimizer step reads its learning rate from a device tensor.
        lr = torch.tensor(options.peak_lr, device=self.device) if options.graph and on_gpu \
            else options.peak_lr
        self.optimizer = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.95),
                                           weight_decay=0.01, fused=on_gpu or None,
                                           capturable=options.graph and on_gpu)
        self.qat = contextlib.ExitStack()
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(training_ops(self.model, self.mtp, compile=options.compile))
        self.moes = moe_layers(self.model, self.mtp)
        self.counts = [moe.experts.backend.counts for moe in self.moes]
        self.shape = plan_shape(sample_maker(self.config_dict, options.recipe), options.seed,
                                options.tokens_per_step) if options.graph else None
        self.source = BatchStream(self.config_dict, options.seed,
                                  self.shape or options.tokens_per_step,
                                  num_workers=options.workers, recipe=options.recipe)
        self.graph_step: GraphStep | None = None
        self.log: list[tuple] = []
        self.pending: list[tuple[int, torch.Tensor, int]] = []
        self.start = time.time()
        self.step_times: list[float] = []

    def step(self) -> torch.Tensor:
        """Train on the next batch; returns its (loss, MTP loss, indexer loss) on the device."""
        qat_from = (1 - self.options.qat_fraction) * self.total_steps
        if self.options.qat_fraction > 0 and self.num_steps >= qat_from and not self.is_qat:
            logger.info("step %d: training through FP8-rounded weights", self.num_steps)
            self.qat.enter_context(fake_fp8(self.config, self.model, self.mtp))
            self.is_qat = True
            if self.graph_step is not None:
                self.graph_step.recapture()
        lr = lr_at(self.num_steps, self.total_steps, self.options.peak_lr,
                   self.options.warmup_steps)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        batch = next(self.source)
        if self.options.graph:
            if self.graph_step is None:
                self.graph_step = GraphStep(self._train_on, batch, self.device, self.config)
            losses = self.graph_step(batch)
            num_trained = self.graph_step.inputs.num_trained
        else:
            inputs = step_tensors(batch, self.device, self.config)
            losses, num_trained = self._train_on(inputs), inputs.num_trained
        self.pending.append((self.num_steps, losses, num_trained))
        self.num_steps += 1
        if self.num_steps % SYNC_EVERY == 0:
            self.flush()
        self.step_times.append(time.time() - self.start)
        return losses

    def _train_on(self, inputs: StepTensors) -> torch.Tensor:
        """Forward, backward and update on one batch on the device; its losses."""
        with self._autocast():
            loss, mtp_loss, index_loss = step_losses(self.model, self.mtp, inputs)
        self.optimizer.zero_grad(set_to_none=True)
        (loss + MTP_LOSS_WEIGHT * mtp_loss + INDEXER_LOSS_WEIGHT * index_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        balance_routers(self.moes, self.counts)
        return torch.stack([loss, mtp_loss, index_loss]).detach()

    def _autocast(self):
        if self.options.amp == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def flush(self) -> None:
        """Move the pending steps' losses into the log (one wait for the device)."""
        if not self.pending:
            return
        values = torch.stack([p[1] for p in self.pending]).tolist()
        seconds = round(time.time() - self.start, 3)
        for (step, _, num_trained), row in zip(self.pending, values, strict=True):
            self.log.append((step, *row, num_trained, seconds))
        self.pending.clear()
        last = self.log[-1]
        if last[0] // 50 != (last[0] - len(values)) // 50 or last[0] < SYNC_EVERY:
            planned = self.total_steps if self.total_steps < 10**9 else "?"
            logger.info("step %d/%s loss %.3f mtp %.3f indexer %.3f (%.0f s)", last[0], planned,
                        *last[1:4], seconds)

    def cpu_models(self):
        """fp32 CPU copies of the network and its MTP layer (what a checkpoint is made of)."""
        model, mtp = build_models(ModelConfig.from_dict(self.config_dict), self.options.seed)
        for target, source in ((model, self.model), (mtp, self.mtp)):
            values = {k.replace(PARAMETRIZED, ".weight"): v for k, v in source.state_dict().items()}
            # Only the target's own names: a router's cached fp32 weight may be listed too.
            target.load_state_dict({k: values[k].detach().cpu() for k in target.state_dict()})
        return model, mtp

    def summary(self, complete: bool) -> dict:
        tail = self.log[-20:]
        mean = lambda i: round(sum(r[i] for r in tail) / max(1, len(tail)), 4)  # noqa: E731
        device = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" \
            else "cpu"
        return dict(variant=VARIANT, seed=self.options.seed, steps=self.num_steps,
                    planned_steps=self.total_steps, complete=complete,
                    tokens_per_step=self.options.tokens_per_step, peak_lr=self.options.peak_lr,
                    warmup_steps=self.options.warmup_steps, device=device, amp=self.options.amp,
                    threads=self.options.threads, qat_fraction=self.options.qat_fraction,
                    graph=self.options.graph, **self._shape_summary(),
                    data_recipe=RECIPES[self.options.recipe],
                    recipe_version=self.options.recipe,
                    trained_tokens=sum(r[4] for r in self.log), final_loss=mean(1),
                    final_mtp_loss=mean(2), final_indexer_loss=mean(3),
                    train_seconds=round(time.time() - self.start), probe=self.probe,
                    torch=torch.__version__)

    def _shape_summary(self) -> dict:
        if self.shape is None:
            return {}
        return dict(sequences_per_step=len(self.shape.lengths),
                    padded_tokens_per_step=self.shape.num_tokens,
                    pictures_per_step=self.shape.pictures)

    def quantization_gap(self) -> dict:
        """Losses of a batch of other data with the weights as trained and rounded to FP8."""
        self.qat.close()
        self.is_qat = False
        batch = make_batch(sample_maker(self.config_dict, self.options.recipe),
                           self.options.seed + GAP_SEED_OFFSET,
                           0, self.options.gap_tokens)
        gap = quantization_gap(self.config, self.model, self.mtp,
                               lambda: forward_losses(self.model, self.mtp, batch))
        for count in self.counts:
            count.zero_()
        return gap

    def close(self) -> None:
        self.source.close()
        self.qat.close()
        self.stack.close()


def probe_losses(model, mtp, config_dict: dict, seed: int, recipe: int) -> dict:
    """The losses of the initial weights (on the CPU, fp32) on the first `PROBE_TOKENS` tokens
    of the run's data, before any update: tests/tiny/test_trained.py replays them from the
    seed. (On the CPU: at random weights many indexer scores tie, and devices break ties
    differently.)"""
    batch = make_batch(sample_maker(config_dict, recipe), seed, 0, PROBE_TOKENS)
    with training_ops(model, mtp), torch.no_grad():
        losses = forward_losses(model, mtp, batch)
    return dict(tokens=PROBE_TOKENS, loss=losses[0].item(), mtp_loss=losses[1].item(),
                indexer_loss=losses[2].item(), trained_tokens=losses[3])


def save_run(run: Training, out: Path, tar: Path | None, *, complete: bool) -> dict:
    """Write the run's checkpoint into `out` (replaced whole) and, if asked, `tar`."""
    run.flush()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    write_trained_checkpoint(staging, run.config_dict, *run.cpu_models())
    with open(staging / "loss_log.csv", "w", newline="") as f:
        csv.writer(f).writerows([LOG_COLUMNS, *run.log])
    summary = run.summary(complete)
    if complete:
        summary["fp8_rounding"] = run.quantization_gap()
    write_manifest(staging, summary)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(staging, out)
    if tar is not None:
        write_tar(out, tar)
    logger.info("saved %s at step %d (%s)", out, run.num_steps,
                "complete" if complete else "partial")
    return summary


def write_tar(folder: Path, tar: Path) -> None:
    """`folder` as an uncompressed tar whose members are `<folder name>/<file>`."""
    tar.parent.mkdir(parents=True, exist_ok=True)
    partial = tar.with_name(tar.name + ".partial")
    with tarfile.open(partial, "w") as archive:
        archive.add(folder, arcname=folder.name)
    os.replace(partial, tar)

