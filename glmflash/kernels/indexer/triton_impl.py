"""Triton DSA indexer selection: pooled-key scores, top-k pools, expansion to token slots.

`indexer_select` = a scoring kernel (per query: relu per head, weighted sum over heads, over the
query's candidate pools only) + the radix top-k of topk_triton.py over each query's candidates
+ an expansion kernel (pool ordinals -> slots of their tokens, then the query's incomplete
pool). Pools and tokens are found through the page table; the per-query plan (row, position,
complete pools) comes from `ref.select_plan` or `ref.decode_select_plan`. Each query's number of
candidates stays on the device, so a CUDA graph captured at a wide `max_pools` pays only for
the pools that exist. Ties may choose and order differently from the reference.
`indexer_write` stays the reference (a few rows per sequence).
"""

from __future__ import annotations

import torch

from glmflash.kernels.indexer.ref import SelectPlan, SelectTiling, indexer_write_ref
from glmflash.kernels.indexer.topk_triton import DEFAULT_CONFIG, TopkConfig, topk_indices

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import dot_operand_type, jit, product_precision

# Pools per scoring program, and the most score elements materialised at once (fp32).
BLOCK_P = 64
# fp32 scores held at once (512 MiB): rows of queries are scored together over every pool of
# their longest sequence, as many rows as fit; the workspace is bounded whatever the context.
TILING = SelectTiling(max_score_elems=1 << 27, pool_tile=1 << 62)


@jit
def _slot_of(page_table, row, pos, stride_pt, PAGE: tl.constexpr, mask):
    """Cache slot of token position `pos` of the sequence in page-table `row` (int64)."""
    page = tl.load(page_table + row * stride_pt + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return page * PAGE + pos % PAGE


@jit(do_not_specialize=("t_begin", "stride_st"))
def indexer_score_kernel(q, weights, pool_keys, page_table, rows, positions, num_pools, scores,
                         lengths, t_begin, scale, stride_qt, stride_qh, stride_wt, stride_pk,
                         stride_pt, stride_st, NH, D, KPOOL: tl.constexpr, PAGE: tl.constexpr,
                         BHQ: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
                         DOT: tl.constexpr, PREC: tl.constexpr):
    """scores[t, p] = sum_h w[t, h] relu(q[t, h] . K_p * scale) for t's candidate pools
    p < lengths[t] (complete and ending at or before t's position); nothing is written past a
    row's candidates (the top-k reads only them)."""
    i_t = tl.program_id(0) + t_begin
    i_p = tl.program_id(1)
    row = tl.load(rows + i_t)
    pos = tl.load(positions + i_t)
    length = tl.minimum(tl.load(num_pools + i_t), (pos + 1) // KPOOL).to(tl.int32)
    if i_p == 0:
        tl.store(lengths + i_t - t_begin, length)
    if i_p * BP < length:
        o_p = i_p * BP + tl.arange(0, BP)
        is_cand = o_p < length
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
        p_s = scores + (i_t - t_begin).to(tl.int64) * stride_st + o_p
        tl.store(p_s, b_s, mask=is_cand)


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
                   topk_config: TopkConfig = DEFAULT_CONFIG,
                   tiling: SelectTiling | None = None) -> torch.Tensor:
    """Triton `indexer_select_ref`: token slots `[T, topk + kpool - 1]` (or `[T, topk]`), -1
    padded. q `[T, H, D]`, weights `[T, H]` fp32, pool_keys `[N / kpool, D]`."""
    num_tokens, heads, dim = q.shape
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.empty(num_tokens, width, dtype=torch.long, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and weights.stride(1) == 1 and pool_keys.stride(1) == 1
    assert page_table.stride(1) == 1 and plan.rows.numel() == num_tokens
    max_pools = plan.max_pools
    num_sel = min(topk // kpool, max_pools)
    bhq = max(16, triton.next_power_of_2(heads))
    per_token = (plan.rows, plan.positions)
    rows = max(1, (tiling or TILING).max_score_elems // max(max_pools, 1))
    for t0 in range(0, num_tokens, rows):
        n = min(rows, num_tokens - t0)
        pools = torch.empty(n, 0, dtype=torch.int32, device=q.device)
        if num_sel:
            scores = torch.empty(n, max_pools, dtype=torch.float32, device=q.device)
            lengths = torch.empty(n, dtype=torch.int32, device=q.device)
            indexer_score_kernel[(n, triton.cdiv(max_pools, BLOCK_P))](
                q, weights, pool_keys, page_table, *per_token, plan.num_pools, scores, lengths,
                t0, dim ** -0.5, q.stride(0), q.stride(1), weights.stride(0),
                pool_keys.stride(0), page_table.stride(0), scores.stride(0), heads, dim,
                KPOOL=kpool,
                PAGE=page_size, BHQ=bhq, BD=max(16, triton.next_power_of_2(dim)), BP=BLOCK_P,
                DOT=dot_operand_type(q.dtype), PREC=product_precision(q.dtype), num_warps=4)
            pools = topk_indices(scores, lengths, num_sel, config=topk_config)
        indexer_expand_kernel[(n,)](
            pools, page_table, *per_token, out, t0, num_sel, width, page_table.stride(0),
            max(pools.stride(0), 1), out.stride(0), KPOOL=kpool, PAGE=page_size,
            SELECT_TAIL=select_tail, BW=triton.next_power_of_2(width), num_warps=4)
    return out


indexer_write = indexer_write_ref

__all__ = ["indexer_select", "indexer_write"]
