"""Owns the model, its cache tensors and the device inputs: ScheduledBatch -> logits to sample."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from glmflash.config import ModelConfig
from glmflash.engine.cache import CacheOps, CachePlan
from glmflash.engine.options import EngineConfig
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.model.dummy_weights import fill_dummy_weights
from glmflash.model.forward_batch import ForwardBatch, build_forward_batch, token_slots_of
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Experts
from glmflash.model.snapshots import StateSnapshots, copy_pages
from glmflash.model.state import ModelState, cache_bytes
from glmflash.model.weights import load_checkpoint
from glmflash.utils.device import upload

logger = logging.getLogger(__name__)
GIB = 1 << 30
DUMMY_WEIGHT_SEED = 0


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
    for module in model.modules():
        if isinstance(module, Experts):
            module.cpu_threads, module.cpu_pools = options.kt_cpuinfer, options.kt_threadpool_count
    # Before the hybrid placement: with pools the kernels replace the weight storage, which
    # must happen before it is page-locked for host-to-device copies.
    warm_up_cpu_experts(model)
    if hybrid:
        from glmflash.engine.experts import ExpertPlacement, place_by_frequency, place_experts

        move_all_but_experts(model, device)
        placement = ExpertPlacement(options.kt_num_gpu_experts,
                                    prefill_token_threshold=options.kt_gpu_prefill_token_threshold)
        place_experts(model, placement, device)
        if options.kt_expert_placement == "frequency" and warmup_ids:
            place_by_frequency(model, placement, device, warmup_ids)
    return model.eval()


def move_all_but_experts(model: GlmForCausalLM, device: torch.device) -> None:
    """Everything but the routed experts goes to the GPU; the experts stay in host RAM."""
    keep = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
    for param in model.parameters():
        if id(param) not in keep:
            param.data = param.data.to(device)


def embed_prompt(model: GlmForCausalLM, config: ModelConfig, mm) -> torch.Tensor:
    """Prompt embeddings with the vision tower's features, computed once per request."""
    from glmflash.multimodal.prompt import MediaTokenIds, embed_multimodal

    with torch.inference_mode():
        return embed_multimodal(model.text.embed_tokens, model.visual, mm.token_ids,
                                mm.image_inputs, mm.video_inputs,
                                media=MediaTokenIds.from_config(config))


def warm_up_cpu_experts(model: GlmForCausalLM) -> None:
    """Build and compile the CPU expert kernels at start, not on the first request."""
    from glmflash.engine.warmup import warm_up_cpu_experts

    warm_up_cpu_experts(model)


def plan_cache(model_config: ModelConfig, config: EngineConfig, max_seq_len: int,
               device: torch.device, dtype: torch.dtype) -> CachePlan:
    """Pages, state slots and prefix-cache snapshots that fit the memory budget; refuses a budget
    below one sequence."""
    page = -(-config.page_size // model_config.index_kpool) * model_config.index_kpool
    per_token, per_slot = cache_bytes(model_config, dtype)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction_static - torch.cuda.memory_allocated(device)
    else:
        budget = config.cache_budget_gb * GIB
    slots, snapshots = config.max_running_requests, config.num_state_snapshots
    pages_per_seq = -(-max_seq_len // page)
    pages = int((budget - (slots + snapshots) * per_slot) // (page * per_token))
    pages = min(pages, slots * pages_per_seq)
    if pages < pages_per_seq:
        raise ValueError(f"cache budget of {budget / GIB:.2f} GiB cannot hold one sequence of "
                         f"{max_seq_len} tokens plus {slots} state slots and {snapshots} "
                         f"snapshots of {per_slot / 2**20:.1f} MiB; raise the budget or lower "
                         f"context_length / max_running_requests / max_state_snapshots")
    plan = CachePlan(num_pages=pages, page_size=page, num_state_slots=slots,
                     max_pages_per_seq=pages_per_seq, num_snapshots=snapshots)
    logger.info("cache plan: %d pages x %d tokens = %d tokens (%.2f GiB), %d sequence slots "
                "(%.1f MiB each)", pages, page, plan.num_token_slots,
                plan.num_token_slots * per_token / GIB, slots, per_slot / 2**20)
    if snapshots:
        logger.info("prefix cache: %d state snapshots (%.2f GiB)", snapshots,
                    snapshots * per_slot / GIB)
    else:
        logger.info("prefix cache: off")
    return plan


class ModelRunner:
    """Turns a ScheduledBatch into a ForwardBatch with O(batch + new tokens) host work.

    The device page table (one row per state slot) persists across steps; the host sends only
    the pages handed out since the previous step. Nothing per step depends on context length.
    """

    def __init__(self, model: GlmForCausalLM, plan: CachePlan) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = plan.page_size
        self.state = ModelState(model.config, num_token_slots=plan.num_token_slots,
                                num_state_slots=plan.num_state_slots, dtype=model.dtype,
                                device=self.device)
        self.page_table = torch.zeros(plan.num_state_slots, plan.max_pages_per_seq,
                                      dtype=torch.int32, device=self.device)
        self.snapshots = StateSnapshots(self.state, plan.num_snapshots) \
            if plan.num_snapshots else None

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[num sampled, V]` of the sequences whose chunk reaches their last token."""
        return self.model(self.prepare(batch), self.state)

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        self.apply_page_updates(batch.page_updates)
        self.apply_cache_ops(batch.cache_ops)
        ids, slots, cu_seqlens, prefix_lens = [], [], [0], []
        page = self.page_size
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            if n == 1:  # a decode: plain Python is cheaper than numpy for one token
                ids.append(seq.token_ids[start])
                slots.append(seq.page_ids[start // page] * page + start % page)
            else:
                ids.extend(seq.token_ids[start:start + n])
                slots.extend(token_slots_of(seq.page_ids, start, n, page).tolist())
            cu_seqlens.append(cu_seqlens[-1] + n)
            prefix_lens.append(start)
        sampled = [b for b, need in enumerate(batch.needs_sample) if need]
        forward_batch = build_forward_batch(
            ids, slots, cu_seqlens, prefix_lens, [seq.state_slot for seq in batch.seqs],
            self.page_table, self.page_size, logit_seqs=sampled)
        forward_batch.input_embeds = self._input_embeds(batch, forward_batch.input_ids,
                                                        cu_seqlens)
        return forward_batch

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

    def _input_embeds(self, batch: ScheduledBatch, input_ids: torch.Tensor,
                      cu_seqlens: list[int]) -> torch.Tensor | None:
        """Token embeddings with the stored visual rows of multimodal prompts spliced in."""
        if all(seq.prompt_embeds is None for seq in batch.seqs):
            return None
        embeds = self.model.text.embed_tokens(input_ids)
        for b, seq in enumerate(batch.seqs):
            start = seq.num_computed_tokens
            end = min(start + batch.num_tokens[b], seq.num_prompt_tokens)
            if seq.prompt_embeds is not None and start < end:
                row = cu_seqlens[b]
                embeds[row: row + end - start] = seq.prompt_embeds[start:end]
        return embeds
