"""Triton DSA indexer selection: pooled-key scores, top-k pools, expansion to token slots.

`indexer_select` = a scoring kernel (per query: relu per head, weighted sum over heads, causal
pool mask) + torch.topk over the pools + an expansion kernel (pool ordinals -> slots of their
tokens, then the query's incomplete pool). Ties may order differently from the reference.
`indexer_write` stays the reference (a few rows per sequence).
"""

from __future__ import annotations

import functools
import os

import torch

from glmflash.kernels.indexer.ref import indexer_write_ref

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

# Pools per scoring program, and the most score elements materialised at once (fp32).
BLOCK_P = 64
MAX_SCORE_ELEMS = 1 << 28


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@_jit
def _token_seq(meta, t, B, LOG_B: tl.constexpr):
    """Sequence of packed token t: binary search over cu_seqlens = meta[0 : B + 1]."""
    lo = t * 0
    hi = lo + B
    for _ in tl.static_range(LOG_B):
        active = lo < hi
        mid = (lo + hi) // 2
        go_right = t >= tl.load(meta + mid + 1)
        lo, hi = tl.where(active & go_right, mid + 1, lo), tl.where(active & ~go_right, mid, hi)
    return lo


@_jit
def indexer_score_kernel(q, weights, pool_keys, ctx, meta, scores, t_begin, B, scale,
                         stride_qt, stride_qh, stride_wt, stride_pk, stride_st, NH, D,
                         KPOOL: tl.constexpr, LOG_B: tl.constexpr, BHQ: tl.constexpr,
                         BD: tl.constexpr, BP: tl.constexpr, DOT: tl.constexpr,
                         PREC: tl.constexpr):
    """scores[t, p] = sum_h w[t, h] relu(q[t, h] . K_p * scale) for candidate pools p (complete
    and ending at or before t's position), -inf otherwise."""
    i_t = tl.program_id(0) + t_begin
    i_p = tl.program_id(1)
    b = _token_seq(meta, i_t, B, LOG_B)
    tok0 = tl.load(meta + b)
    ctx0 = tl.load(meta + (B + 1) + b)
    num_pools = (tl.load(meta + (B + 1) + b + 1) - ctx0) // KPOOL
    pos = tl.load(meta + 2 * (B + 1) + b) + i_t - tok0
    o_p = i_p * BP + tl.arange(0, BP)
    is_cand = (o_p < num_pools) & ((o_p + 1) * KPOOL - 1 <= pos)
    b_out = tl.full([BP], float("-inf"), dtype=tl.float32)
    if i_p * BP * KPOOL <= pos:
        o_h = tl.arange(0, BHQ)
        o_d = tl.arange(0, BD)
        m_h, m_d = o_h < NH, o_d < D
        i_t64 = i_t.to(tl.int64)
        b_q = tl.load(q + i_t64 * stride_qt + o_h[:, None] * stride_qh + o_d[None, :],
                      mask=m_h[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BHQ, BD]
        b_w = tl.load(weights + i_t64 * stride_wt + o_h, mask=m_h, other=0.0).to(tl.float32)
        slot = tl.load(ctx + ctx0 + o_p.to(tl.int64) * KPOOL, mask=is_cand, other=0)
        p_k = pool_keys + (slot // KPOOL).to(tl.int64)[:, None] * stride_pk + o_d[None, :]
        b_k = tl.load(p_k, mask=is_cand[:, None] & m_d[None, :], other=0.0).to(DOT)  # [BP, BD]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * scale  # [BHQ, BP]
        b_s = tl.sum(tl.maximum(b_s, 0.0) * b_w[:, None], 0)
        b_out = tl.where(is_cand, b_s, b_out)
    p_s = scores + (i_t - t_begin).to(tl.int64) * stride_st + o_p
    tl.store(p_s, b_out, mask=o_p < stride_st)


@_jit
def indexer_expand_kernel(pools, ctx, meta, out, t_begin, B, num_sel, width, stride_pt,
                          stride_ot, KPOOL: tl.constexpr, LOG_B: tl.constexpr,
                          SELECT_TAIL: tl.constexpr, BW: tl.constexpr):
    """Row t of the selection: the slots of each chosen pool's KPOOL tokens, then the tail
    (the query's own incomplete pool), then -1, as the reference lays it out."""
    i_t = tl.program_id(0) + t_begin
    b = _token_seq(meta, i_t, B, LOG_B)
    tok0 = tl.load(meta + b)
    ctx0 = tl.load(meta + (B + 1) + b)
    pos = tl.load(meta + 2 * (B + 1) + b) + i_t - tok0
    o_c = tl.arange(0, BW)
    i_t64 = (i_t - t_begin).to(tl.int64)
    sel = o_c // KPOOL
    pool = tl.load(pools + i_t64 * stride_pt + sel, mask=sel < num_sel, other=-1)
    tok = tl.where(pool >= 0, pool * KPOOL + o_c % KPOOL, -1)
    if SELECT_TAIL:
        visible = pos + 1
        r = o_c - num_sel * KPOOL
        tail = visible - visible % KPOOL + r
        in_tail = (r >= 0) & (r < KPOOL - 1)
        tok = tl.where(in_tail, tl.where(tail < visible, tail, -1), tok)
    valid = tok >= 0
    slot = tl.load(ctx + ctx0 + tl.where(valid, tok, 0).to(tl.int64), mask=valid, other=-1)
    tl.store(out + (i_t.to(tl.int64)) * stride_ot + o_c, tl.where(valid, slot, -1),
             mask=o_c < width)


@functools.lru_cache(maxsize=16)
def _meta(cu_seqlens: tuple[int, ...], cu_context: tuple[int, ...], prefix_lens: tuple[int, ...],
          device: torch.device) -> torch.Tensor:
    """[cu_seqlens (B+1) | cu_context (B+1) | prefix_lens (B)] as int32 on the device."""
    return torch.tensor(cu_seqlens + cu_context + prefix_lens, dtype=torch.int32).to(device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   context_slots: torch.Tensor, cu_context: list[int], cu_seqlens: list[int],
                   prefix_lens: list[int], *, topk: int, kpool: int,
                   select_tail: bool) -> torch.Tensor:
    """Triton `indexer_select_ref`: token slots `[T, topk + kpool - 1]` (or `[T, topk]`), -1
    padded. q `[T, H, D]`, weights `[T, H]` fp32, pool_keys `[N / kpool, D]`."""
    num_tokens, heads, dim = q.shape
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.empty(num_tokens, width, dtype=torch.long, device=q.device)
    num_seqs = len(prefix_lens)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and weights.stride(1) == 1 and pool_keys.stride(1) == 1
    assert context_slots.is_contiguous() and len(cu_seqlens) == num_seqs + 1
    meta = _meta(tuple(cu_seqlens), tuple(cu_context), tuple(prefix_lens), q.device)
    log_b = max(1, (num_seqs).bit_length())
    max_pools = max((cu_context[b + 1] - cu_context[b]) // kpool for b in range(num_seqs))
    num_sel = min(topk // kpool, max_pools)
    fp32 = q.dtype == torch.float32 or _interpreting()
    dot = tl.float32 if fp32 else (tl.float16 if q.dtype == torch.float16 else tl.bfloat16)
    bhq = max(16, triton.next_power_of_2(heads))
    rows = max(1, MAX_SCORE_ELEMS // max(max_pools, 1))
    for t0 in range(0, num_tokens, rows):
        n = min(rows, num_tokens - t0)
        pools = torch.empty(n, 0, dtype=torch.long, device=q.device)
        if num_sel:
            scores = torch.empty(n, max_pools, dtype=torch.float32, device=q.device)
            indexer_score_kernel[(n, triton.cdiv(max_pools, BLOCK_P))](
                q, weights, pool_keys, context_slots, meta, scores, t0, num_seqs, dim ** -0.5,
                q.stride(0), q.stride(1), weights.stride(0), pool_keys.stride(0),
                scores.stride(0), heads, dim, KPOOL=kpool, LOG_B=log_b, BHQ=bhq,
                BD=max(16, triton.next_power_of_2(dim)), BP=BLOCK_P, DOT=dot,
                PREC="ieee" if fp32 else "tf32", num_warps=4)
            values, pools = scores.topk(num_sel, dim=1)
            pools = pools.masked_fill(values == float("-inf"), -1)
        indexer_expand_kernel[(n,)](
            pools, context_slots, meta, out, t0, num_seqs, num_sel, width,
            max(pools.stride(0), 1), out.stride(0), KPOOL=kpool, LOG_B=log_b,
            SELECT_TAIL=select_tail, BW=triton.next_power_of_2(width), num_warps=4)
    return out


indexer_write = indexer_write_ref

__all__ = ["indexer_select", "indexer_write"]
