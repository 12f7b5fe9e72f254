"""Train the tiny model (the `trained` variant of glmflash/tiny/configs.py) and write it in the
release layout with a manifest:

    python tools/train_tiny.py OUT_DIR [--seed 0] [--steps 560] [--tokens-per-step 2048]

The network is the project's own (glmflash.model) with the reference ops under autograd, on the
CPU; the data is made by tools/tiny_data.py from the seed. Losses are logged and written to
OUT_DIR/loss_log.csv; the same seed, steps and thread count give the same checkpoint.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.tiny.checkpoint import write_trained_checkpoint
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.manifest import write_manifest
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer
from glmflash.utils.logging import setup_logging
from tools.tiny_data import RECIPE, Sample, SampleMaker, Seen, make_sample
from tools.tiny_trainer import (
    INDEXER_LOSS_WEIGHT,
    MTP_LOSS_WEIGHT,
    balance_routers,
    build_models,
    forward_losses,
    lr_at,
    routers,
)

logger = logging.getLogger("glmflash.train_tiny")
VARIANT = "trained"


def batches(maker: SampleMaker, seed: int, max_tokens: int,
            seen: Seen | None = None) -> Iterator[list[Sample]]:
    """Endless deterministic batches of whole samples, at most `max_tokens` tokens each
    (`seen` records what they contain)."""
    rng, pending = random.Random(seed), None
    while True:
        batch, size = [], 0
        while True:
            sample = pending or make_sample(maker, rng, seen)
            pending = None
            if batch and size + len(sample.ids) > max_tokens:
                pending = sample
                break
            batch.append(sample)
            size += len(sample.ids)
        yield batch


class Training:
    """The models, optimizer and data stream of one run; `step()` trains on one batch."""

    def __init__(self, seed: int, total_steps: int, max_tokens: int, peak_lr: float) -> None:
        torch.manual_seed(seed)
        self.config_dict = tiny_config(VARIANT)
        config = ModelConfig.from_dict(self.config_dict)
        self.model, self.mtp = build_models(config, seed)
        self.params = [p for m in (self.model, self.mtp) for p in m.parameters()
                       if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=peak_lr, betas=(0.9, 0.95),
                                           weight_decay=0.01)
        self.counts = [torch.zeros(config.n_routed_experts, dtype=torch.long)
                       for _ in routers(self.model, self.mtp)]
        for router, count in zip(routers(self.model, self.mtp), self.counts, strict=True):
            router.counts = count
        tokenizer_dir = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-"))
        write_tiny_tokenizer(tokenizer_dir)
        self.source = batches(SampleMaker(tokenizer_dir, config), seed, max_tokens)
        self.total_steps, self.peak_lr, self.num_steps = total_steps, peak_lr, 0

    def step(self) -> tuple[float, float, int]:
        """(loss, MTP loss, indexer loss, assistant tokens) of the next batch, after the update."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.num_steps, self.total_steps, self.peak_lr, warmup=30)
        loss, mtp_loss, index_loss, num_trained = forward_losses(self.model, self.mtp,
                                                                 next(self.source))
        self.optimizer.zero_grad(set_to_none=True)
        (loss + MTP_LOSS_WEIGHT * mtp_loss + INDEXER_LOSS_WEIGHT * index_loss).backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        balance_routers(self.model, self.mtp, self.counts)
        self.num_steps += 1
        return loss.item(), mtp_loss.item(), index_loss.item(), num_trained

    def finish(self, out: Path) -> None:
        for router in routers(self.model, self.mtp):
            router.counts = None
        write_trained_checkpoint(out, self.config_dict, self.model, self.mtp)


def train(out: Path, seed: int, steps: int, max_tokens: int, peak_lr: float) -> dict:
    run = Training(seed, steps, max_tokens, peak_lr)
    log, start = [], time.time()
    for step in range(steps):
        log.append((step, *run.step(), time.time() - start))
        if step % 10 == 0 or step == steps - 1:
            logger.info("step %d/%d loss %.3f mtp %.3f indexer %.3f (%.0f s)", step, steps,
                        *log[-1][1:4], log[-1][5])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "loss_log.csv", "w", newline="") as f:
        csv.writer(f).writerows([("step", "loss", "mtp_loss", "indexer_loss", "trained_tokens",
                                  "seconds"),
                                 *log])
    run.finish(out)
    tail = log[-20:]
    return dict(variant=VARIANT, seed=seed, steps=steps, tokens_per_step=max_tokens,
                peak_lr=peak_lr, threads=torch.get_num_threads(), data_recipe=RECIPE,
                final_loss=round(sum(r[1] for r in tail) / len(tail), 4),
                final_mtp_loss=round(sum(r[2] for r in tail) / len(tail), 4),
                final_indexer_loss=round(sum(r[3] for r in tail) / len(tail), 4),
                train_seconds=round(log[-1][5]), torch=torch.__version__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=560)
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a shared machine)")
    args = parser.parse_args()
    setup_logging()
    torch.set_num_threads(args.threads)
    training = train(args.out, args.seed, args.steps, args.tokens_per_step, args.lr)
    write_manifest(args.out, training)
    logger.info("wrote %s: %s", args.out, json.dumps(training))


if __name__ == "__main__":
    main()
