"""DSA k-pool indexer: pool compression on write and top-k pool selection (spec/model.md §4.4-4.5).

Cache layout: a sequence's token at position p lives in cache slot
`page_table[row, p // page_size] * page_size + p % page_size`, where `row` is its state slot;
page_size is a multiple of kpool, so the kpool tokens of one pool occupy kpool consecutive slots
starting at a multiple of kpool, and the pooled key of that pool lives at
`pool_keys[slot // kpool]`, in the model dtype or as an FP8 row (key_format.py). The raw
(key, gate) rows of a sequence's incomplete pool live in `tail[row]` (`[kpool - 1, 2 *
head_dim]`); their count is `context_len % kpool`.
Host lists delimit sequences: `cu_seqlens` (new tokens), `prefix_lens` (cached before),
`state_slots` (page-table rows). Nothing here reads a device value on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from glmflash.kernels.indexer import key_format
from glmflash.utils.device import upload


def compress_pools(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """keys, gates `[P, kpool, D]` -> pooled keys `[P, D]`: per-channel softmax over the pool."""
    probs = torch.softmax(gates.float() + ape.float(), dim=1).to(keys.dtype)
    return (probs * keys).sum(dim=1)


def token_slots(page_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                page_size: int) -> torch.Tensor:
    """Cache slots of token `positions` (any shape) of the sequences in page-table `rows`
    (broadcastable to it); positions must lie inside the table's width."""
    pages = page_table[rows, torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages * page_size + positions % page_size


class WritePlan(NamedTuple):
    """Which rows `indexer_write` reads and writes, the same for every layer of a forward.

    Row numbers index `[tail rows (S * (kpool-1)) | new rows (T)]`.
    """

    pool_sources: torch.Tensor  # [P, kpool] rows of each newly completed pool's tokens
    pool_rows: torch.Tensor  # [P] page-table row of each completed pool
    pool_starts: torch.Tensor  # [P] position of each completed pool's first token
    tail_sources: torch.Tensor  # [R] rows of the new incomplete pools' tokens
    tail_targets: torch.Tensor  # [R] tail rows they are written to


def write_plan(cu_seqlens: list[int], prefix_lens: list[int], state_slots: list[int],
               num_state_slots: int, kpool: int, device: torch.device) -> WritePlan:
    """Host-side index arithmetic (O(new tokens)), uploaded once per forward."""
    width = kpool - 1
    new_base = num_state_slots * width
    sources, rows, starts, tail_src, tail_dst = [], [], [], [], []
    for b, (prefix, slot) in enumerate(zip(prefix_lens, state_slots, strict=True)):
        total = prefix + cu_seqlens[b + 1] - cu_seqlens[b]

        def source(pos: np.ndarray, prefix=prefix, slot=slot, start=cu_seqlens[b]) -> np.ndarray:
            old = slot * width + pos - (prefix - prefix % kpool)
            return np.where(pos < prefix, old, new_base + start + pos - prefix)

        pool_start = np.arange(prefix // kpool, total // kpool, dtype=np.int64) * kpool
        sources.append(source(pool_start[:, None] + np.arange(kpool)))
        rows.append(np.full(pool_start.shape, slot))
        starts.append(pool_start)
        tail = np.arange(total - total % kpool, total, dtype=np.int64)
        tail_src.append(source(tail))
        tail_dst.append(slot * width + np.arange(tail.size))
    cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, np.int64)  # noqa: E731
    pools = np.concatenate(sources) if sources else np.zeros((0, kpool), np.int64)
    packed = [pools.reshape(-1), cat(rows), cat(starts), cat(tail_src), cat(tail_dst)]
    sizes = [p.size for p in packed]
    parts = upload(np.concatenate(packed).astype(np.int64), device).split(sizes)
    return WritePlan(parts[0].view(-1, kpool), *parts[1:])


def indexer_write_ref(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                      pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                      plan: WritePlan, *, page_size: int) -> None:
    """Fold the new tokens' keys/gates `[T, D]` into completed pools and the per-sequence tail."""
    kpool, dim = ape.shape
    # Every row a pool or a new tail may need: the stored tails, then the new tokens (a copy, so
    # the tail can be overwritten below).
    source = torch.cat([tail.reshape(-1, 2 * dim),
                        torch.cat([keys, gates], dim=-1).to(tail.dtype)])
    pending = source[plan.pool_sources]  # [P, kpool, 2D]
    slots = token_slots(page_table, plan.pool_rows, plan.pool_starts, page_size)
    pool_keys[slots // kpool] = key_format.encode(
        pool_keys, compress_pools(pending[..., :dim], pending[..., dim:], ape))
    tail.view(-1, 2 * dim)[plan.tail_targets] = source[plan.tail_sources]


def indexer_write_decode(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, *, page_size: int) -> None:
    """`indexer_write_ref` for one new token per sequence (row i of keys / gates), with the
    rows and positions on the device (fixed shapes, nothing read on the host: a CUDA graph can
    replay it).

    The token at position p goes to slot p % kpool of its pool. When it completes the pool, the
    pool is compressed from the tail rows and it; otherwise it joins the tail. Both writes are
    made for every row, the one that does not apply writing back what is already there.
    """
    kpool, dim = ape.shape
    new = torch.cat([keys, gates], dim=-1).to(tail.dtype)  # [B, 2D]
    offset = positions % kpool
    completes = (offset == kpool - 1)[:, None]
    pool = torch.cat([tail[rows], new[:, None]], dim=1)  # [B, kpool, 2D]
    pooled = key_format.encode(pool_keys, compress_pools(pool[..., :dim], pool[..., dim:], ape))
    # A pool starts at a multiple of kpool, so its first token's slot locates its key.
    target = token_slots(page_table, rows, positions - offset, page_size) // kpool
    pool_keys[target] = torch.where(completes, pooled, pool_keys[target])
    if kpool > 1:  # (a pool of one token has no tail)
        column = offset.clamp(max=kpool - 2)
        tail[rows, column] = torch.where(completes, tail[rows, column], new)


class SelectRows(NamedTuple):
    """A group of query rows scored together."""

    idx: torch.Tensor  # [n] query rows
    max_pools: int  # host maximum of the rows' complete pools
    shared: bool  # all queries of one sequence (keys scored once)


class SelectPlan(NamedTuple):
    """Per query row (device): page-table row, position in its sequence, complete pools in its
    sequence after this forward; and the groups the reference scores together."""

    rows: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    num_pools: torch.Tensor  # [T]
    max_pools: int
    groups: list[SelectRows]


def select_plan(cu_seqlens: list[int], prefix_lens: list[int], state_slots: list[int],
                kpool: int, device: torch.device) -> SelectPlan:
    """Host arithmetic O(new tokens), one upload. Decodes (one new token) form one group; each
    longer chunk its own."""
    rows, positions, num_pools, spans = [], [], [], []
    for b, (prefix, slot) in enumerate(zip(prefix_lens, state_slots, strict=True)):
        n = cu_seqlens[b + 1] - cu_seqlens[b]
        rows.append(np.full(n, slot))
        positions.append(np.arange(prefix, prefix + n))
        num_pools.append(np.full(n, (prefix + n) // kpool))
        spans.append(((prefix + n) // kpool, n))
    decodes = [cu_seqlens[b] for b, (_, n) in enumerate(spans) if n == 1]
    parts = [np.concatenate(a).astype(np.int64) if a else np.zeros(0, np.int64)
             for a in (rows, positions, num_pools)] + [np.asarray(decodes, np.int64)]
    sizes = [p.size for p in parts]
    dev_rows, dev_pos, dev_pools, dev_decodes = upload(np.concatenate(parts), device).split(sizes)
    groups = []
    if decodes:
        groups.append(SelectRows(dev_decodes, max(p for p, n in spans if n == 1), False))
    for b, (pools, n) in enumerate(spans):
        if n > 1:
            idx = torch.arange(cu_seqlens[b], cu_seqlens[b + 1], device=device)
            groups.append(SelectRows(idx, pools, True))
    return SelectPlan(dev_rows, dev_pos, dev_pools, max((p for p, _ in spans), default=0), groups)


def decode_select_plan(rows: torch.Tensor, positions: torch.Tensor, kpool: int,
                       max_pools: int) -> SelectPlan:
    """The plan of one query per sequence from device rows and positions: one group scored over
    `max_pools` pools (a bound on every row's complete pools), nothing read on the host."""
    num_pools = torch.div(positions + 1, kpool, rounding_mode="floor")
    every = torch.arange(rows.numel(), device=rows.device)
    return SelectPlan(rows, positions, num_pools, max_pools,
                      [SelectRows(every, max_pools, False)] if rows.numel() else [])


class SelectTiling(NamedTuple):
    """Bounds on the scoring workspace of `indexer_select`, independent of context length.

    Pools are scored `pool_tile` at a time and merged into the best k found so far (exact: the
    top k of a union is the top k of each part's top k); query rows are taken as many at a time
    as keep one tile's score elements under `max_score_elems`.
    """

    max_score_elems: int
    pool_tile: int

    def row_tile(self, pools_per_tile: int, elems_per_pool: int) -> int:
        """Query rows per tile when each row scores `pools_per_tile` pools of
        `elems_per_pool` elements."""
        return max(1, self.max_score_elems // max(1, pools_per_tile * elems_per_pool))


# The reference holds [rows, heads, pools] scores and, for decode rows, [rows, pools, D] keys.
REF_TILING = SelectTiling(max_score_elems=1 << 25, pool_tile=4096)


def indexer_select_ref(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                       page_table: torch.Tensor, plan: SelectPlan, *, page_size: int,
                       topk: int, kpool: int, select_tail: bool,
                       tiling: SelectTiling | None = None,
                       weight_scale: float = 1.0, fp8_queries: bool = False) -> torch.Tensor:
    """Token slots attended by each query: `[T, topk + kpool - 1]` (or `[T, topk]`), -1 padded.

    q `[T, H, D]`, weights `[T, H]`; the head weights are `weights.float() * weight_scale`
    (the model passes H^-1/2). Score of pool p for query t:
    sum_h w_h relu(q_h . K_p / sqrt(D)); candidates end at or before t; the best
    min(topk / kpool, candidates) pools are kept, best first, then the query's incomplete pool is
    appended. `plan` comes from `select_plan`; `tiling` bounds the scores held at once.
    `fp8_queries` (FP8 pooled keys only): each query row q_h is first quantised as the keys
    are (`key_format.quantize_queries`), DeepSeek's FP8 indexer.
    """
    if fp8_queries and not key_format.is_fp8(pool_keys):
        raise ValueError("fp8_queries: the pooled keys must be FP8 too")
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.full((q.shape[0], width), -1, dtype=torch.long, device=q.device)
    weights = weights.float() * weight_scale
    q_scales = None
    if fp8_queries:
        q, q_scales = key_format.quantize_queries(q)
    scorer = _Scorer(q, weights, pool_keys, page_table, page_size, topk // kpool, kpool, width,
                     select_tail, tiling or REF_TILING, q_scales)
    for group in plan.groups:
        out[group.idx] = scorer.select(plan, group)
    return out


def merge_best(best_scores: torch.Tensor, best_pools: torch.Tensor, scores: torch.Tensor,
               pools: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The best k of (best so far `[n, k']`, a new tile `[n, P]`), best first; `pools` `[n, P]`
    holds the tile's pool ordinals (-1 for non-candidates)."""
    scores = torch.cat([best_scores, scores], dim=1)
    chosen = scores.topk(min(k, scores.shape[1]), dim=1)
    return chosen.values, torch.cat([best_pools, pools], dim=1).gather(1, chosen.indices)


class _Scorer:
    """Scoring and expansion for groups of query rows, each row with its own context."""

    def __init__(self, q, weights, pool_keys, page_table, page_size, max_pools, kpool, width,
                 select_tail, tiling, q_scales=None) -> None:
        self.q, self.weights, self.pool_keys = q.float(), weights.float(), pool_keys
        # e4m3 queries: codes in `q`, and their scales `[T, H]` taken after the products
        self.q_scales = q_scales
        self.page_table, self.page_size = page_table, page_size
        self.max_pools, self.kpool = max_pools, kpool
        self.width, self.select_tail, self.tiling = width, select_tail, tiling
        self.scale = q.shape[-1] ** -0.5

    def select(self, plan: SelectPlan, group: SelectRows) -> torch.Tensor:
        """Attended slots `[n, width]` of the group's rows."""
        rows, positions = plan.rows[group.idx], plan.positions[group.idx]
        pools = self._pools(group, rows, positions, plan.num_pools[group.idx])
        return self._expand(pools, rows, positions)

    def _pools(self, group: SelectRows, rows: torch.Tensor, positions: torch.Tensor,
               num_pools: torch.Tensor) -> torch.Tensor:
        """Chosen pool ordinals per row `[n, k]`, -1 where fewer candidates than k exist."""
        most = group.max_pools
        if most == 0:
            return torch.empty(group.idx.numel(), 0, dtype=torch.long, device=self.q.device)
        heads, dim = self.q.shape[1:]
        pool_tile = min(self.tiling.pool_tile, most)
        row_tile = self.tiling.row_tile(pool_tile, heads + dim)
        parts = []
        for r0 in range(0, group.idx.numel(), row_tile):
            part = slice(r0, r0 + row_tile)
            tile_rows = rows[:1] if group.shared else rows[part]
            parts.append(self._best_pools(group, group.idx[part], tile_rows, positions[part],
                                          num_pools[part], pool_tile))
        return torch.cat(parts)

    def _best_pools(self, group: SelectRows, idx: torch.Tensor, rows: torch.Tensor,
                    positions: torch.Tensor, num_pools: torch.Tensor,
                    pool_tile: int) -> torch.Tensor:
        """`_pools` for some query rows, scoring `pool_tile` pools at a time."""
        k = min(self.max_pools, group.max_pools)
        device = self.q.device
        best = (torch.empty(idx.numel(), 0, device=device),
                torch.empty(idx.numel(), 0, dtype=torch.long, device=device))
        for p0 in range(0, group.max_pools, pool_tile):
            ordinal = torch.arange(p0, min(p0 + pool_tile, group.max_pools), device=device)
            best = self._merge_tile(best, ordinal, idx, rows, positions, num_pools,
                                    group.shared, k)
        return best[1]

    def _merge_tile(self, best: tuple[torch.Tensor, torch.Tensor], ordinal: torch.Tensor,
                    idx: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    num_pools: torch.Tensor, shared: bool,
                    k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The best k after scoring pools `ordinal` (a function, so that one tile's scores are
        freed before the next tile's are made)."""
        scores = self._scores(idx, rows, ordinal, shared)  # [n, P]
        pool_end = (ordinal + 1) * self.kpool - 1
        candidate = (pool_end[None, :] <= positions[:, None]) & \
            (ordinal[None, :] < num_pools[:, None])
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
        pools = torch.where(candidate, ordinal[None, :], -1)
        return merge_best(*best, scores, pools, k)

    def _scores(self, idx: torch.Tensor, rows: torch.Tensor, ordinal: torch.Tensor,
                shared: bool) -> torch.Tensor:
        """Index scores `[n, P]` of query rows `idx` against pools `ordinal` of their
        sequences (page-table `rows`, one row when the group is `shared`)."""
        first_token = token_slots(self.page_table, rows[:, None], ordinal * self.kpool,
                                  self.page_size)  # [n or 1, P]
        rows = self.pool_keys[first_token // self.kpool]
        # FP8 keys: the scores of the codes, times each key's scale after the sum over heads
        # (relu commutes with a positive factor), as the Triton kernels take them.
        keys, key_scales = key_format.split(rows) if key_format.is_fp8(rows) else \
            (rows.float(), None)
        q = self.q[idx]
        if shared:
            scores = torch.einsum("nhd,pd->nhp", q, keys[0])
        else:
            scores = torch.einsum("nhd,npd->nhp", q, keys)
        if self.q_scales is not None:
            scores = scores * (self.q_scales[idx] * self.scale)[..., None]
        else:
            scores = scores * self.scale
        scores = torch.relu(scores)
        scores = torch.einsum("nh,nhp->np", self.weights[idx], scores)
        return scores if key_scales is None else scores * key_scales

    def _expand(self, pools: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor
                ) -> torch.Tensor:
        """Pool ordinals -> the slots of their tokens, plus the tail of the query's own pool."""
        offsets = torch.arange(self.kpool, device=pools.device)
        token_pos = (pools[..., None] * self.kpool + offsets).flatten(1)
        token_pos = token_pos.masked_fill((pools < 0).repeat_interleave(self.kpool, dim=1), -1)
        if self.select_tail:
            visible = positions + 1
            tail_pos = (visible - visible % self.kpool)[:, None] + offsets[: self.kpool - 1]
            tail_pos = tail_pos.masked_fill(tail_pos >= visible[:, None], -1)
            token_pos = torch.cat([token_pos, tail_pos], dim=1)
        gathered = token_slots(self.page_table, rows[:, None], token_pos.clamp(min=0),
                               self.page_size)
        slots = torch.where(token_pos >= 0, gathered, -1)
        pad = self.width - slots.shape[1]
        return torch.nn.functional.pad(slots, (0, pad), value=-1) if pad > 0 \
            else slots[:, : self.width]
