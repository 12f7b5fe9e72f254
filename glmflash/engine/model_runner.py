"""Owns the model, its cache tensors and the device inputs: ScheduledBatch -> logits to sample."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from glmflash.config import ModelConfig
from glmflash.engine.cache import CacheOps, CachePlan
from glmflash.engine.options import EngineConfig
from glmflash.engine.prompt_logprobs import PromptLogprobTracker
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.step_inputs import StepInputs, collect_inputs
from glmflash.model.dummy_weights import fill_dummy_weights
from glmflash.model.forward_batch import (
    ForwardBatch,
    build_forward_batch,
    decode_batch,
    pack_decode,
)
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.layers import stack_weights
from glmflash.model.moe import Experts
from glmflash.model.snapshots import StateSnapshots, copy_pages
from glmflash.model.state import ModelState
from glmflash.model.weights import load_checkpoint
from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.engine.cuda_graph import CapturedDecode

logger = logging.getLogger(__name__)
DUMMY_WEIGHT_SEED = 0
# Pools scored by the narrowest decode selection (16K tokens at the release's kpool of 4).
FIRST_SELECTION_WIDTH = 4096


def load_model(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               options: EngineConfig | None = None,
               warmup_ids: list[int] | None = None) -> GlmForCausalLM:
    """Load the checkpoint; on a GPU with `kt_num_gpu_experts` set, routed experts stay on the
    CPU (all but N per layer are computed there; `warmup_ids` feed frequency placement).

    With `load_format="dummy"` the weights are seeded random values made in memory instead.
    """
    options = options or EngineConfig()
    hybrid = device.type == "cuda" and options.kt_num_gpu_experts is not None
    with torch.device("cpu" if hybrid else device):
        model = GlmForCausalLM(config, dtype)
    if options.load_format == "dummy":
        fill_dummy_weights(model, seed=DUMMY_WEIGHT_SEED)
    else:
        load_checkpoint(model, path, num_layers=config.num_hidden_layers)
    return place_model(model, device, options, hybrid, warmup_ids)


def place_model(model: GlmForCausalLM, device: torch.device, options: EngineConfig,
                hybrid: bool, warmup_ids: list[int] | None = None) -> GlmForCausalLM:
    """After loading: CPU expert kernels built with the options and warm; with `hybrid`,
    everything but the routed experts moved to `device`, the resident experts chosen (once)
    and placed (once)."""
    # Before the hybrid placement: with pools the kernels replace the weight storage, which
    # must happen before it is page-locked for host-to-device copies.
    warm_up_cpu_experts(model, options.kt_cpuinfer, options.kt_threadpool_count)
    if hybrid:
        from glmflash.engine.experts import place_experts, plan_placement

        move_all_but_experts(model, device)
        place_experts(model, plan_placement(model, options, device, warmup_ids), device)
    stack_weights(model)
    return model.eval()


def move_all_but_experts(model: GlmForCausalLM, device: torch.device) -> None:
    """Everything but the routed experts goes to the GPU; the experts stay in host RAM."""
    keep = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    for param in model.parameters():
        if id(param) not in keep:
            param.data = param.data.to(device)


def warm_up_cpu_experts(model: GlmForCausalLM, num_threads: int | None = None,
                        num_pools: int = 1) -> None:
    """Build and compile the CPU expert kernels at start, not on the first request."""
    from glmflash.engine.warmup import warm_up_cpu_experts

    warm_up_cpu_experts(model, num_threads, num_pools)


def plan_cache(model_config: ModelConfig, config: EngineConfig, max_seq_len: int,
               device: torch.device, dtype: torch.dtype) -> CachePlan:
    """Pages and state slots that fit the memory budget (engine/memory_plan.py, which logs the
    ledger); refuses a budget below one sequence."""
    from glmflash.engine.memory_plan import plan_memory

    return plan_memory(model_config, config, max_seq_len, device, dtype)[0]


class DecodeHostRows(NamedTuple):
    """A batch of decodes on the host, one entry per sequence."""

    input_ids: list[int]
    token_slots: list[int]
    positions: list[int]
    state_slots: list[int]
    num_pools: int
    """The most complete indexer pools of any of the sequences after this step."""


class DecodeStep(NamedTuple):
    """One step of decodes as it travels: the rows, and the cache changes to make first."""

    rows: DecodeHostRows
    page_updates: list[tuple[int, int, int]]
    cache_ops: CacheOps | None


def selection_widths(max_pools: int, first: int = FIRST_SELECTION_WIDTH) -> list[int]:
    """Pools a decode's indexer scores: 4x steps from `first` up to the longest sequence's."""
    widths, width = [], min(first, max_pools)
    while width < max_pools:
        widths.append(width)
        width *= 4
    return widths + [max_pools]


class ModelRunner:
    """Turns a ScheduledBatch into a ForwardBatch with O(batch + new tokens) host work.

    The device page table (one row per state slot) persists across steps; the host sends only
    the pages handed out since the previous step. Nothing per step depends on context length.
    Batches of decodes take the device-resident decode form, replayed from CUDA graphs once
    `capture_graphs` has run. One state slot and one page beyond the plan are reserved for the
    padding rows of replays; no sequence is ever given them.
    """

    def __init__(self, model: GlmForCausalLM, plan: CachePlan,
                 state_config: ModelConfig | None = None) -> None:
        """`state_config`: the layers the cache holds, when more than the model's (the MTP
        layer's, `with_mtp_layer`)."""
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = plan.page_size
        self.dummy_slot, self.dummy_page = plan.num_state_slots, plan.num_pages
        self.state = ModelState(state_config or model.config,
                                num_token_slots=plan.num_token_slots + plan.page_size,
                                num_state_slots=plan.num_state_slots + 1, dtype=model.dtype,
                                device=self.device, fp8_index_keys=plan.fp8_index_keys,
                                fp8_index_queries=plan.fp8_index_queries)
        self.page_table = torch.zeros(plan.num_state_slots + 1, plan.max_pages_per_seq,
                                      dtype=torch.int32, device=self.device)
        self.page_table[self.dummy_slot] = self.dummy_page
        self.kpool = model.config.index_kpool
        self.pool_widths = selection_widths(plan.max_pages_per_seq * plan.page_size // self.kpool)
        self.graphs = None
        """The CudaGraphRunner once `capture_graphs` has run."""
        self.prompt_logprobs = PromptLogprobTracker()
        self.snapshots = StateSnapshots(self.state, plan.num_snapshots) \
            if plan.num_snapshots else None

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[num sampled, V]` of the sequences whose chunk reaches their last token.

        Prompt log-probabilities asked for are scored on the way and stored on their sequences.
        """
        prompt_rows = self.prompt_logprobs.plan(batch)
        if prompt_rows is not None:
            logits = self.run_inputs(collect_inputs(batch, self.page_size, prompt_rows.rows))
            num_sampled = logits.shape[0] - len(prompt_rows.rows)
            self.prompt_logprobs.record(logits[num_sampled:], prompt_rows)
            return logits[:num_sampled]
        step = self.decode_step(batch)
        if step is not None:
            return self.run_decode(step)
        return self.run_inputs(collect_inputs(batch, self.page_size))

    def run_inputs(self, inputs: StepInputs) -> torch.Tensor:
        """Logits of a step in the varlen form (prefill chunks, mixed batches, prompt rows)."""
        return self.model(self.prepare_inputs(inputs), self.state)

    def run_decode(self, step: DecodeStep) -> torch.Tensor:
        """Logits of a batch of decodes: a graph replay when one holds the batch, else the
        decode form eagerly. (The other ranks of a split model make the same choice: they
        captured the same sizes.)"""
        captured = self.replay_decode(step)
        if captured is not None:
            return captured.logits[: len(step.rows.input_ids)]
        return self.model(self.prepare_decode(step), self.state)

    def replay_decode(self, step: DecodeStep) -> CapturedDecode | None:
        """The captured decode graph replayed for `step` (its rows first in the outputs), or
        None when no graph holds the batch."""
        if self.graphs is None or not self.graphs.can_replay(len(step.rows.input_ids)):
            return None
        self.apply_cache_changes(step.page_updates, step.cache_ops)
        return self.graphs.replay_captured(step.rows)

    def check_graph_experts(self) -> None:
        """Once the host has read a step's outputs (every replay of the step has then run):
        raise if the CPU experts inside the graphs failed during it, before its tokens are
        used (the check right after a replay, which does not wait, sees only earlier ones)."""
        if self.graphs is not None and self.graphs.handoff is not None:
            self.graphs.handoff.check()

    def prepare(self, batch: ScheduledBatch,
                extra_logit_rows: list[int] | None = None) -> ForwardBatch:
        """The batch's forward inputs, cache changes applied: the decode form for a batch of
        decodes, else the varlen form (always with prompt rows to score)."""
        step = None if extra_logit_rows else self.decode_step(batch)
        if step is not None:
            return self.prepare_decode(step)
        return self.prepare_inputs(collect_inputs(batch, self.page_size, extra_logit_rows))

    def prepare_decode(self, step: DecodeStep) -> ForwardBatch:
        self.apply_cache_changes(step.page_updates, step.cache_ops)
        return decode_batch(upload(self.pack_decode(step.rows), self.device), self.page_table,
                            self.page_size, self.pool_width(step.rows.num_pools))

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        from glmflash.engine.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self, batch_sizes)
        self.graphs.capture()

    def close(self) -> None:
        from glmflash.engine.experts import close_placement

        if self.graphs is not None:
            self.graphs.close()
        close_placement(self.model)

    def decode_step(self, batch: ScheduledBatch) -> DecodeStep | None:
        """The batch as a step of decodes with its cache changes, or None (`decode_rows`)."""
        rows = self.decode_rows(batch)
        return None if rows is None else DecodeStep(rows, list(batch.page_updates),
                                                    batch.cache_ops)

    def decode_rows(self, batch: ScheduledBatch) -> DecodeHostRows | None:
        """The batch as decodes, or None when a sequence has more than one new token, none
        cached before, a prompt row or no token to sample."""
        if not all(batch.needs_sample) or any(n != 1 for n in batch.num_tokens):
            return None
        page = self.page_size
        ids, slots, positions, state_slots = [], [], [], []
        for seq in batch.seqs:
            start = seq.num_computed_tokens
            if start == 0 or (seq.prompt_embeds is not None and start < seq.num_prompt_tokens):
                return None
            ids.append(seq.token_ids[start])
            slots.append(seq.page_ids[start // page] * page + start % page)
            positions.append(start)
            state_slots.append(seq.state_slot)
        return DecodeHostRows(ids, slots, positions, state_slots,
                              (max(positions) + 1) // self.kpool)

    def padding_rows(self, num_rows: int) -> DecodeHostRows:
        """Rows that touch only the reserved slot and page."""
        return DecodeHostRows([0] * num_rows, [self.dummy_page * self.page_size] * num_rows,
                              [0] * num_rows, [self.dummy_slot] * num_rows, 0)

    def pack_decode(self, rows: DecodeHostRows, pad_to: int | None = None) -> np.ndarray:
        """The decode batch's device words (`pack_decode`), padded to `pad_to` rows."""
        num_pad = (pad_to or len(rows.input_ids)) - len(rows.input_ids)
        pad = self.padding_rows(num_pad)
        return pack_decode(rows.input_ids + pad.input_ids, rows.token_slots + pad.token_slots,
                           rows.positions + pad.positions, rows.state_slots + pad.state_slots,
                           [0] * len(rows.input_ids) + [1] * num_pad)

    def pool_width(self, num_pools: int) -> int:
        """The narrowest selection width that holds `num_pools` pools."""
        return next(w for w in self.pool_widths if w >= num_pools)

    def prepare_inputs(self, inputs: StepInputs) -> ForwardBatch:
        """The device side of a varlen step: page-table updates, the prefix cache's copies, one
        upload, spliced rows."""
        self.apply_cache_changes(inputs.page_updates, inputs.cache_ops)
        forward_batch = build_forward_batch(
            inputs.input_ids, inputs.token_slots, inputs.cu_seqlens, inputs.prefix_lens,
            inputs.state_slots, self.page_table, self.page_size, logit_seqs=inputs.logit_seqs,
            extra_logit_rows=inputs.extra_logit_rows)
        forward_batch.input_embeds = self._input_embeds(forward_batch.input_ids,
                                                        inputs.embed_rows)
        return forward_batch

    def apply_cache_changes(self, page_updates: list[tuple[int, int, int]],
                            cache_ops: CacheOps | None) -> None:
        """What the cache manager did since the last step: pages handed out, then the prefix
        cache's copies (every path into a forward makes both, in this order)."""
        self.apply_page_updates(page_updates)
        self.apply_cache_ops(cache_ops)

    def apply_page_updates(self, updates: list[tuple[int, int, int]]) -> None:
        """Mirror pages handed out by the cache manager into the device page table."""
        if updates:
            slot, index, page = upload(np.asarray(updates, dtype=np.int64).T, self.device)
            self.page_table[slot, index] = page.to(torch.int32)

    def apply_cache_ops(self, ops: CacheOps | None) -> None:
        """The prefix cache's copies, in order: snapshots of finished chunks, then the partial
        pages and snapshots that sequences starting from a cached prefix begin with."""
        if not ops:
            return
        if ops.saves:
            self.snapshots.save(self.state, *zip(*ops.saves, strict=True))
        if ops.page_copies:
            copy_pages(self.state, *zip(*ops.page_copies, strict=True), self.page_size)
        if ops.loads:
            self.snapshots.load(self.state, *zip(*ops.loads, strict=True))

    def _input_embeds(self, input_ids: torch.Tensor,
                      embed_rows: list[tuple[int, torch.Tensor]]) -> torch.Tensor | None:
        """Token embeddings with the stored visual rows of multimodal prompts spliced in."""
        if not embed_rows:
            return None
        embeds = self.model.text.embed_tokens(input_ids)
        for row, rows in embed_rows:
            embeds[row: row + rows.shape[0]] = rows.to(embeds.device)
        return embeds
