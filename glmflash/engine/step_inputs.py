"""`StepInputs`: the host side of one forward, built from a ScheduledBatch in O(batch + new
tokens) work. It holds no device tensors (multimodal rows stay where they were computed), so the
same record drives the runner here and, sent as is, the runners of the other ranks."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from glmflash.engine.cache import CacheOps
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.model.forward_batch import token_slots_of


@dataclass(slots=True)
class StepInputs:
    input_ids: list[int]
    """New tokens of every sequence, back to back."""
    token_slots: list[int]
    """Cache slot of each new token."""
    cu_seqlens: list[int]
    prefix_lens: list[int]
    state_slots: list[int]
    logit_seqs: list[int]
    """Sequences whose last new token is sampled."""
    page_updates: list[tuple[int, int, int]] = field(default_factory=list)
    """(state slot, page index, page id) handed out since the previous step."""
    embed_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    """(first row, embeddings `[n, D]`) of multimodal prompt rows that replace the lookup."""
    extra_logit_rows: list[int] | None = None
    """Rows whose logits follow the sampled ones (prompt log-probabilities)."""
    cache_ops: CacheOps | None = None
    """The prefix cache's state copies to make before the forward (every rank makes them)."""


def collect_inputs(batch: ScheduledBatch, page_size: int,
                   extra_logit_rows: list[int] | None = None) -> StepInputs:
    ids, slots, cu_seqlens, prefix_lens = [], [], [0], []
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        start = seq.num_computed_tokens
        if n == 1:  # a decode: plain Python is cheaper than numpy for one token
            ids.append(seq.token_ids[start])
            slots.append(seq.page_ids[start // page_size] * page_size + start % page_size)
        else:
            ids.extend(seq.token_ids[start:start + n])
            slots.extend(token_slots_of(seq.page_ids, start, n, page_size).tolist())
        cu_seqlens.append(cu_seqlens[-1] + n)
        prefix_lens.append(start)
    return StepInputs(ids, slots, cu_seqlens, prefix_lens, [seq.state_slot for seq in batch.seqs],
                      [b for b, need in enumerate(batch.needs_sample) if need],
                      list(batch.page_updates), _embed_rows(batch, cu_seqlens), extra_logit_rows,
                      batch.cache_ops)


def _embed_rows(batch: ScheduledBatch, cu_seqlens: list[int]) -> list[tuple[int, torch.Tensor]]:
    """The stored visual rows of multimodal prompts that this step's chunk covers."""
    rows = []
    for b, seq in enumerate(batch.seqs):
        start = seq.num_computed_tokens
        end = min(start + batch.num_tokens[b], seq.num_prompt_tokens)
        if seq.prompt_embeds is not None and start < end:
            rows.append((cu_seqlens[b], seq.prompt_embeds[start:end]))
    return rows
