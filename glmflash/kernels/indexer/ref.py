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
    device = keys.device
    width = kpool - 1
    # Every row a pool or the new tail may need: the stored tails, then the new tokens.
    source = torch.cat([tail.reshape(-1, 2 * dim),
                        torch.cat([keys, gates], dim=-1).to(tail.dtype)])
    prefix = torch.tensor(prefix_lens, device=device)
    total = prefix + torch.tensor(cu_seqlens, device=device).diff()
    slots = torch.tensor(state_slots, device=device)
    seq_start = torch.tensor(cu_seqlens[:-1], device=device)

    def rows(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Row in `source` of absolute position `pos` of sequence `seq` (same shapes)."""
        old_base = prefix[seq] - prefix[seq] % kpool
        in_tail = slots[seq] * width + (pos - old_base)
        new = tail.shape[0] * width + seq_start[seq] + (pos - prefix[seq])
        return torch.where(pos < prefix[seq], in_tail, new)

    first_pool, end_pool = prefix // kpool, total // kpool
    seq = torch.repeat_interleave(torch.arange(len(state_slots), device=device),
                                  end_pool - first_pool)
    if seq.numel():
        offsets = torch.cumsum(end_pool - first_pool, 0) - (end_pool - first_pool)
        pool = first_pool[seq] + torch.arange(seq.numel(), device=device) - offsets[seq]
        members = pool[:, None] * kpool + torch.arange(kpool, device=device)  # [P, kpool]
        pending = source[rows(seq[:, None].expand_as(members), members)]  # [P, kpool, 2D]
        ctx_start = torch.tensor(cu_context[:-1], device=device)
        pool_slots = context_slots[ctx_start[seq] + pool * kpool] // kpool
        pool_keys[pool_slots] = compress_pools(pending[..., :dim], pending[..., dim:], ape).to(
            pool_keys.dtype)
    count = total % kpool
    seq = torch.repeat_interleave(torch.arange(len(state_slots), device=device), count)
    if seq.numel():
        offsets = torch.cumsum(count, 0) - count
        j = torch.arange(seq.numel(), device=device) - offsets[seq]
        pos = total[seq] - count[seq] + j
        tail.view(-1, 2 * dim)[slots[seq] * width + j] = source[rows(seq, pos)]


def indexer_select_ref(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                       context_slots: torch.Tensor, cu_context: list[int],
                       cu_seqlens: list[int], prefix_lens: list[int], *, topk: int,
                       kpool: int, select_tail: bool) -> torch.Tensor:
    """Token slots attended by each query: `[T, topk + kpool - 1]` (or `[T, topk]`), -1 padded.

    q `[T, H, D]`, weights `[T, H]` fp32 (already scaled by H^-1/2). Score of pool p for query t:
    sum_h w_h relu(q_h . K_p / sqrt(D)); candidates end at or before t; the best
    min(topk / kpool, candidates) pools are kept, then the query's incomplete pool is appended.
    Single-token sequences (decodes) are scored together; a longer chunk shares its keys.
    """
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    rows = _Rows(q, weights, pool_keys, context_slots, topk // kpool, kpool, width, select_tail)
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(prefix_lens))]
    decodes = [b for b, n in enumerate(lens) if n == 1]
    if decodes:
        idx = torch.tensor([cu_seqlens[b] for b in decodes], device=q.device)
        out[idx] = rows.select(idx, [cu_context[b] for b in decodes],
                               [cu_context[b + 1] - cu_context[b] for b in decodes],
                               [prefix_lens[b] for b in decodes], shared=False)
    for b, n in enumerate(lens):
        if n > 1:
            idx = torch.arange(cu_seqlens[b], cu_seqlens[b + 1], device=q.device)
            ctx_len = cu_context[b + 1] - cu_context[b]
            out[idx] = rows.select(idx, [cu_context[b]] * n, [ctx_len] * n,
                                   list(range(prefix_lens[b], prefix_lens[b] + n)), shared=True)
    return out


class _Rows:
    """Scoring and expansion for a set of query rows, each with its own context."""

    def __init__(self, q, weights, pool_keys, context_slots, max_pools, kpool, width,
                 select_tail) -> None:
        self.q, self.weights, self.pool_keys = q.float(), weights.float(), pool_keys
        self.context_slots, self.max_pools, self.kpool = context_slots, max_pools, kpool
        self.width, self.select_tail = width, select_tail
        self.scale = q.shape[-1] ** -0.5

    def select(self, idx: torch.Tensor, ctx_start: list[int], ctx_len: list[int],
               positions: list[int], *, shared: bool) -> torch.Tensor:
        """Attended slots `[n, width]` of rows `idx`; `shared`: all rows have one context."""
        device = idx.device
        start = torch.tensor(ctx_start, device=device)
        num_pools = torch.tensor(ctx_len, device=device) // self.kpool
        pos = torch.tensor(positions, device=device)
        pools = self._pools(idx, start, num_pools, pos, shared)
        return self._expand(pools, pos, start)

    def _pools(self, idx, start, num_pools, pos, shared) -> torch.Tensor:
        """Chosen pool ordinals per row `[n, k]`, -1 where fewer candidates than k exist."""
        most = int(num_pools.max())
        if most == 0:
            return torch.empty(idx.numel(), 0, dtype=torch.long, device=idx.device)
        ordinal = torch.arange(most, device=idx.device)
        first_token = (start[:, None] + ordinal * self.kpool).clamp(
            max=self.context_slots.numel() - 1)
        slots = self.context_slots[first_token] // self.kpool  # [n, P]
        q = self.q[idx]
        if shared:
            keys = self.pool_keys[slots[0]].float()
            scores = torch.relu(torch.einsum("nhd,pd->nhp", q, keys) * self.scale)
        else:
            keys = self.pool_keys[slots].float()
            scores = torch.relu(torch.einsum("nhd,npd->nhp", q, keys) * self.scale)
        index_scores = torch.einsum("nh,nhp->np", self.weights[idx], scores)
        pool_end = (ordinal + 1) * self.kpool - 1
        candidate = (pool_end[None, :] <= pos[:, None]) & (ordinal[None, :] < num_pools[:, None])
        index_scores = index_scores.masked_fill(~candidate, torch.finfo(index_scores.dtype).min)
        chosen = index_scores.topk(min(self.max_pools, most), dim=-1).indices
        return chosen.masked_fill(~candidate.gather(1, chosen), -1)

    def _expand(self, pools: torch.Tensor, pos: torch.Tensor, start: torch.Tensor
                ) -> torch.Tensor:
        """Pool ordinals -> the slots of their tokens, plus the tail of the query's own pool."""
        offsets = torch.arange(self.kpool, device=pools.device)
        token_pos = (pools[..., None] * self.kpool + offsets).flatten(1)
        token_pos = token_pos.masked_fill((pools < 0).repeat_interleave(self.kpool, dim=1), -1)
        if self.select_tail:
            visible = pos + 1
            tail_pos = (visible - visible % self.kpool)[:, None] + offsets[: self.kpool - 1]
            tail_pos = tail_pos.masked_fill(tail_pos >= visible[:, None], -1)
            token_pos = torch.cat([token_pos, tail_pos], dim=1)
        gathered = self.context_slots[(start[:, None] + token_pos.clamp(min=0))
                                      .clamp(max=self.context_slots.numel() - 1)]
        slots = torch.where(token_pos >= 0, gathered, -1)
        pad = self.width - slots.shape[1]
        return torch.nn.functional.pad(slots, (0, pad), value=-1) if pad > 0 \
            else slots[:, : self.width]
