"""DSA k-pool indexer: pool compression on write and top-k pool selection (spec/model.md §4.4-4.5).

Cache layout: token slots are grouped so that the kpool tokens of one pool occupy kpool
consecutive slots starting at a multiple of kpool; the pooled key of that pool lives at
`pool_keys[slot // kpool]`. The raw (key, gate) rows of a sequence's incomplete pool live in
`tail[state_slot]` (`[kpool - 1, 2 * head_dim]`); their count is `context_len % kpool`.
Host lists delimit sequences: `cu_seqlens` (new tokens), `prefix_lens` (cached before),
`cu_context` (offsets into `context_slots`, the slots of each sequence's whole context).
"""

from __future__ import annotations

import torch


def compress_pools(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates `[P, kpool, D]` -> pooled keys `[P, D]`: per-channel softmax over the pool."""
    probs = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def indexer_write_ref(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                      pool_keys: torch.Tensor, tail: torch.Tensor, context_slots: torch.Tensor,
                      cu_context: list[int], cu_seqlens: list[int], prefix_lens: list[int],
                      state_slots: list[int]) -> None:
    """Fold the new tokens' keys/gates `[T, D]` into completed pools and the per-sequence tail."""
    kpool, dim = ape.shape
    for b, slot in enumerate(state_slots):
        prefix, start, end = prefix_lens[b], cu_seqlens[b], cu_seqlens[b + 1]
        num_old = prefix % kpool
        old = tail[slot, :num_old]
        new = torch.cat([keys[start:end], gates[start:end]], dim=-1).to(tail.dtype)
        pending = torch.cat([old, new])
        num_pools = pending.shape[0] // kpool
        if num_pools:
            rows = pending[: num_pools * kpool].view(num_pools, kpool, 2 * dim)
            first_pool = prefix // kpool
            token_pos = (first_pool + torch.arange(num_pools, device=keys.device)) * kpool
            pool_slots = context_slots[cu_context[b] + token_pos] // kpool
            pool_keys[pool_slots] = compress_pools(rows[..., :dim], rows[..., dim:], ape).to(
                pool_keys.dtype)
        rest = pending[num_pools * kpool:]
        tail[slot, : rest.shape[0]] = rest


def indexer_select_ref(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                       context_slots: torch.Tensor, cu_context: list[int],
                       cu_seqlens: list[int], prefix_lens: list[int], *, topk: int,
                       kpool: int, select_tail: bool) -> torch.Tensor:
    """Token slots attended by each query: `[T, topk + kpool - 1]` (or `[T, topk]`), -1 padded.

    q `[T, H, D]`, weights `[T, H]` fp32 (already scaled by H^-1/2). Score of pool p for query t:
    sum_h w_h relu(q_h . K_p / sqrt(D)); candidates end at or before t; the best
    min(topk / kpool, candidates) pools are kept, then the query's incomplete pool is appended.
    """
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    scale = q.shape[-1] ** -0.5
    for b in range(len(prefix_lens)):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        ctx = context_slots[cu_context[b]: cu_context[b + 1]]
        positions = prefix_lens[b] + torch.arange(end - start, device=q.device)
        num_pools = ctx.shape[0] // kpool
        pools = _select_pools(q[start:end], weights[start:end], pool_keys, ctx, positions,
                              num_pools, topk // kpool, kpool, scale)
        out[start:end] = _expand(pools, positions, ctx, kpool, width, select_tail)
    return out


def _select_pools(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                  ctx: torch.Tensor, positions: torch.Tensor, num_pools: int, max_pools: int,
                  kpool: int, scale: float) -> torch.Tensor:
    """Chosen pool ordinals per query `[n, k]`, -1 where fewer candidates than k exist."""
    n = q.shape[0]
    if num_pools == 0:
        return torch.empty(n, 0, dtype=torch.long, device=q.device)
    keys = pool_keys[ctx[torch.arange(num_pools, device=q.device) * kpool] // kpool].float()
    scores = torch.relu(torch.einsum("nhd,pd->nhp", q.float(), keys) * scale)
    index_scores = torch.einsum("nh,nhp->np", weights.float(), scores)
    pool_end = (torch.arange(num_pools, device=q.device) + 1) * kpool - 1
    candidate = pool_end[None, :] <= positions[:, None]
    index_scores = index_scores.masked_fill(~candidate, torch.finfo(index_scores.dtype).min)
    chosen = index_scores.topk(min(max_pools, num_pools), dim=-1).indices
    return chosen.masked_fill(~candidate.gather(1, chosen), -1)


def _expand(pools: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, kpool: int,
            width: int, select_tail: bool) -> torch.Tensor:
    """Pool ordinals -> the slots of their tokens, plus the tail of the query's own pool."""
    offsets = torch.arange(kpool, device=pools.device)
    token_pos = (pools[..., None] * kpool + offsets).flatten(1)
    token_pos = token_pos.masked_fill((pools < 0).repeat_interleave(kpool, dim=1), -1)
    if select_tail:
        visible = positions + 1
        tail_start = visible - visible % kpool
        tail_pos = tail_start[:, None] + offsets[: kpool - 1]
        tail_pos = tail_pos.masked_fill(tail_pos >= visible[:, None], -1)
        token_pos = torch.cat([token_pos, tail_pos], dim=1)
    slots = torch.where(token_pos >= 0, ctx[token_pos.clamp(min=0)], -1)
    pad = width - slots.shape[1]
    return torch.nn.functional.pad(slots, (0, pad), value=-1) if pad > 0 else slots[:, :width]
