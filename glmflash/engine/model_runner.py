"""Owns the model, its cache tensors and the device inputs: ScheduledBatch -> logits to sample."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.engine.cache import CachePlan
from glmflash.engine.options import EngineConfig
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Experts
from glmflash.model.state import ModelState, cache_bytes
from glmflash.model.weights import load_checkpoint

logger = logging.getLogger(__name__)
GIB = 1 << 30


def load_model(path: Path, config: ModelConfig, device: torch.device, dtype: torch.dtype,
               options: EngineConfig | None = None,
               warmup_ids: list[int] | None = None) -> GlmForCausalLM:
    """Load the checkpoint; on a GPU with `kt_num_gpu_experts` set, routed experts stay on the
    CPU (all but N per layer are computed there; `warmup_ids` feed frequency placement)."""
    options = options or EngineConfig()
    hybrid = device.type == "cuda" and options.kt_num_gpu_experts is not None
    with torch.device("cpu" if hybrid else device):
        model = GlmForCausalLM(config, dtype)
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
    """Pages and state slots that fit the memory budget; refuses a budget below one sequence."""
    page = -(-config.page_size // model_config.index_kpool) * model_config.index_kpool
    per_token, per_slot = cache_bytes(model_config, dtype)
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        budget = total * config.mem_fraction_static - torch.cuda.memory_allocated(device)
    else:
        budget = config.cache_budget_gb * GIB
    slots = config.max_running_requests
    pages_per_seq = -(-max_seq_len // page)
    pages = int((budget - slots * per_slot) // (page * per_token))
    pages = min(pages, slots * pages_per_seq)
    if pages < pages_per_seq:
        raise ValueError(f"cache budget of {budget / GIB:.2f} GiB cannot hold one sequence of "
                         f"{max_seq_len} tokens plus {slots} state slots of "
                         f"{per_slot / 2**20:.1f} MiB; raise the budget or lower "
                         f"context_length / max_running_requests")
    plan = CachePlan(num_pages=pages, page_size=page, num_state_slots=slots)
    logger.info("cache plan: %d pages x %d tokens = %d tokens (%.2f GiB), %d sequence slots "
                "(%.1f MiB each)", pages, page, plan.num_token_slots,
                plan.num_token_slots * per_token / GIB, slots, per_slot / 2**20)
    return plan


class ModelRunner:
    def __init__(self, model: GlmForCausalLM, plan: CachePlan) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self.page_size = plan.page_size
        self.state = ModelState(model.config, num_token_slots=plan.num_token_slots,
                                num_state_slots=plan.num_state_slots, dtype=model.dtype,
                                device=self.device)

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits `[num sampled, V]` of the sequences whose chunk reaches their last token."""
        forward_batch = self.prepare(batch)
        logits = self.model(forward_batch, self.state)
        rows = [i for i, need in enumerate(batch.needs_sample) if need]
        return logits[rows]

    def prepare(self, batch: ScheduledBatch) -> ForwardBatch:
        ids = []
        cu_seqlens, cu_context, prefix_lens = [0], [0], []
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            cu_seqlens.append(len(ids))
            cu_context.append(cu_context[-1] + start + n)
            prefix_lens.append(start)
        tables = [seq.page_ids for seq in batch.seqs]
        seq_index = torch.repeat_interleave(torch.arange(len(tables)),
                                            torch.tensor(cu_context).diff())
        context_pos = torch.arange(cu_context[-1]) - torch.tensor(cu_context[:-1])[seq_index]
        context_slots = self._slots(tables, seq_index, context_pos)
        new_rows = torch.cat([torch.arange(cu_context[b] + prefix_lens[b], cu_context[b + 1])
                              for b in range(len(tables))])
        to_device = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        input_ids = to_device(torch.tensor(ids))
        return ForwardBatch(input_ids=input_ids, cu_seqlens=cu_seqlens, prefix_lens=prefix_lens,
                            state_slots=[seq.state_slot for seq in batch.seqs],
                            token_slots=to_device(context_slots[new_rows]),
                            context_slots=to_device(context_slots), cu_context=cu_context,
                            input_embeds=self._input_embeds(batch, input_ids, cu_seqlens))

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

    def _slots(self, tables: list[list[int]], seq_index: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return table[seq_index, positions // self.page_size] * self.page_size + \
            positions % self.page_size
