"""Triton DSA indexer selection: pooled-key scores, top-k pools, expansion to token slots.

`indexer_select` = a scoring kernel (per query: relu per head, weighted sum over heads, causal
pool mask) + torch.topk over the pools + an expansion kernel (pool ordinals -> slots of their
tokens, then the query's incomplete pool). Pools and tokens are found through the page table;
the per-query plan (row, position, complete pools) comes from `ref.select_plan`. Ties may
order differently from the reference. Scores are held for at most `TILING.pool_tile` pools of
at most `max_score_elems / (pool_tile + k)` queries at a time, each pool tile's scores written
after the best k so far and merged by one topk: the workspace does not grow with context, and
the selection stays exact.
`indexer_write` stays the reference (a few rows per sequence).
"""

from __future__ import annotations

import torch

from glmflash.kernels.indexer.ref import SelectPlan, SelectTiling, indexer_write_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import interpreting, jit

# Pools per scoring program.
BLOCK_P = 64
# fp32 score elements held at once (512 MiB), and pools scored per pass (256K tokens at kpool 4:
# one pass up to that context).
TILING = SelectTiling(max_score_elems=1 << 27, pool_tile=1 << 16)


@jit
def _slot_of(page_table, row, pos, stride_pt, PAGE: tl.constexpr, mask):
    """Cache slot of token position `pos` of the sequence in page-table `row` (int64)."""
    page = tl.load(page_table + row * stride_pt + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return page * PAGE + pos % PAGE


@jit(do_not_specialize=("t_begin", "p_begin", "num_cols", "stride_st"))
def indexer_score_kernel(q, weights, pool_keys, page_table, rows, positions, num_pools, scores,
                         t_begin, p_begin, num_cols, scale, stride_qt, stride_qh, stride_wt,
                         stride_pk, stride_pt, stride_st, NH, D, KPOOL: tl.constexpr,
                         PAGE: tl.constexpr, BHQ: tl.constexpr, BD: tl.constexpr,
                         BP: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """scores[t, c] = sum_h w[t, h] relu(q[t, h] . K_p * scale) for pool p = p_begin + c when p
    is a candidate (complete and ending at or before t's position), -inf otherwise; columns
    c < num_cols."""
    i_t = tl.program_id(0) + t_begin
    i_p = tl.program_id(1)
    row = tl.load(rows + i_t)
    pos = tl.load(positions + i_t)
    o_c = i_p * BP + tl.arange(0, BP)
    o_p = p_begin + o_c
    is_cand = (o_p < tl.load(num_pools + i_t)) & ((o_p + 1) * KPOOL - 1 <= pos) & \
        (o_c < num_cols)
    b_out = tl.full([BP], float("-inf"), dtype=tl.float32)
    if (p_begin + i_p * BP) * KPOOL <= pos:
        o_h = tl.arange(0, BHQ)
        o_d = tl.arange(0, BD)
        m_h, m_d = o_h < NH, o_d < D
        i_t64 = i_t.to(tl.int64)
        b_q = tl.load(q + i_t64 * stride_qt + o_h[:, None] * stride_qh + o_d[None, :],
                      mask=m_h[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BHQ, BD]
        b_w = tl.load(weights + i_t64 * stride_wt + o_h, mask=m_h, other=0.0).to(tl.float32)
        slot = _slot_of(page_table, row, o_p.to(tl.int64) * KPOOL, stride_pt, PAGE, is_cand)
        p_k = pool_keys + (slot // KPOOL)[:, None] * stride_pk + o_d[None, :]
        b_k = tl.load(p_k, mask=is_cand[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BP, BD]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale  # [BHQ, BP]
        b_s = tl.sum(tl.maximum(b_s, 0.0) * b_w[:, None], 0)
        b_out = tl.where(is_cand, b_s, b_out)
    p_s = scores + (i_t - t_begin).to(tl.int64) * stride_st + o_c
    tl.store(p_s, b_out, mask=o_c < num_cols)


@jit(do_not_specialize=("t_begin", "num_sel", "stride_pot"))
def indexer_expand_kernel(pools, page_table, rows, positions, out, t_begin, num_sel, width,
                          stride_pt, stride_pot, stride_ot, KPOOL: tl.constexpr,
                          PAGE: tl.constexpr, SELECT_TAIL: tl.constexpr, BW: tl.constexpr):
    """Row t of the selection: the slots of each chosen pool's KPOOL tokens, then the tail
    (the query's own incomplete pool), then -1, as the reference lays it out."""
    i_t = tl.program_id(0) + t_begin
    row = tl.load(rows + i_t)
    pos = tl.load(positions + i_t)
    o_c = tl.arange(0, BW)
    i_t64 = (i_t - t_begin).to(tl.int64)
    sel = o_c // KPOOL
    pool = tl.load(pools + i_t64 * stride_pot + sel, mask=sel < num_sel, other=-1)
    tok = tl.where(pool >= 0, pool * KPOOL + o_c % KPOOL, -1)
    if SELECT_TAIL:
        visible = pos + 1
        r = o_c - num_sel * KPOOL
        tail = visible - visible % KPOOL + r
        in_tail = (r >= 0) & (r < KPOOL - 1)
        tok = tl.where(in_tail, tl.where(tail < visible, tail, -1), tok)
    valid = tok >= 0
    slot = _slot_of(page_table, row, tl.where(valid, tok, 0).to(tl.int64), stride_pt, PAGE, valid)
    tl.store(out + (i_t.to(tl.int64)) * stride_ot + o_c, tl.where(valid, slot, -1),
             mask=o_c < width)



def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   page_table: torch.Tensor, plan: SelectPlan, *, page_size: int, topk: int,
                   kpool: int, select_tail: bool,
                   tiling: SelectTiling | None = None) -> torch.Tensor:
    """Triton `indexer_select_ref`: token slots `[T, topk + kpool - 1]` (or `[T, topk]`), -1
    padded. q `[T, H, D]`, weights `[T, H]` fp32, pool_keys `[N / kpool, D]`."""
    num_tokens = q.shape[0]
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.empty(num_tokens, width, dtype=torch.long, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and weights.stride(1) == 1 and pool_keys.stride(1) == 1
    assert page_table.stride(1) == 1 and plan.rows.numel() == num_tokens
    tiling = tiling or TILING
    num_sel = min(topk // kpool, plan.max_pools)
    # A tile holds at least k pools, so the first one fills the best k.
    pool_tile = min(max(tiling.pool_tile, num_sel), plan.max_pools)
    rows = tiling.row_tile(pool_tile + num_sel, 1)
    scorer = _TileScorer(q, weights, pool_keys, page_table, plan, page_size, kpool)
    for t0 in range(0, num_tokens, rows):
        n = min(rows, num_tokens - t0)
        pools = scorer.best_pools(t0, n, num_sel, pool_tile) if num_sel else \
            torch.empty(n, 0, dtype=torch.long, device=q.device)
        indexer_expand_kernel[(n,)](
            pools, page_table, plan.rows, plan.positions, out, t0, num_sel, width,
            page_table.stride(0), max(pools.stride(0), 1), out.stride(0), KPOOL=kpool,
            PAGE=page_size, SELECT_TAIL=select_tail, BW=triton.next_power_of_2(width),
            num_warps=4)
    return out


class _TileScorer:
    """Scores query rows against one pool tile at a time and keeps their best pools."""

    def __init__(self, q, weights, pool_keys, page_table, plan, page_size, kpool) -> None:
        self.q, self.weights, self.pool_keys, self.page_table = q, weights, pool_keys, page_table
        self.plan, self.page_size, self.kpool = plan, page_size, kpool
        fp32 = q.dtype == torch.float32 or interpreting()
        self.dot = tl.float32 if fp32 else (tl.float16 if q.dtype == torch.float16
                                            else tl.bfloat16)
        self.prec = "ieee" if fp32 else "tf32"

    def best_pools(self, t0: int, n: int, k: int, pool_tile: int) -> torch.Tensor:
        """Pool ordinals `[n, k]` of rows t0.. (best first, -1 where fewer candidates). After
        the first tile the best k so far sit in columns :k of the buffer, the tile after them."""
        scores = torch.empty(n, pool_tile + (k if self.plan.max_pools > pool_tile else 0),
                             dtype=torch.float32, device=self.q.device)
        best = None
        for p0 in range(0, self.plan.max_pools, pool_tile):
            num_cols = min(pool_tile, self.plan.max_pools - p0)
            lead = 0 if best is None else k
            self._score(scores[:, lead: lead + num_cols], t0, n, p0, num_cols)
            values, index = scores[:, : lead + num_cols].topk(k, dim=1)
            pools = index + (p0 - lead)
            if best is not None:
                pools = torch.where(index < k, best.gather(1, index.clamp(max=k - 1)), pools)
            best = pools.masked_fill(values == float("-inf"), -1)
            if p0 + pool_tile < self.plan.max_pools:
                scores[:, :k] = values
        return best

    def _score(self, scores: torch.Tensor, t0: int, n: int, p0: int, num_cols: int) -> None:
        q, plan = self.q, self.plan
        heads, dim = q.shape[1:]
        indexer_score_kernel[(n, triton.cdiv(num_cols, BLOCK_P))](
            q, self.weights, self.pool_keys, self.page_table, plan.rows, plan.positions,
            plan.num_pools, scores, t0, p0, num_cols, dim ** -0.5, q.stride(0), q.stride(1),
            self.weights.stride(0), self.pool_keys.stride(0), self.page_table.stride(0),
            scores.stride(0), heads, dim, KPOOL=self.kpool, PAGE=self.page_size,
            BHQ=max(16, triton.next_power_of_2(heads)),
            BD=max(16, triton.next_power_of_2(dim)), BP=BLOCK_P, DOT=self.dot, PREC=self.prec,
            num_warps=4)


indexer_write = indexer_write_ref

__all__ = ["indexer_select", "indexer_write"]
