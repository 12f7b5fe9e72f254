"""Triton KDA: short causal conv, fused recurrent decode step, chunked prefill (README.md).

Same signatures and semantics as ref.py. Per-sequence metadata (host lists) is packed into one
int32 tensor per distinct batch and cached, so the 34 KDA layers of a forward share one copy.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

# Chunk length of the prefill kernels (sub-chunks of 16 rows inside).
CHUNK = 64
# Diagonal sub-blocks use exp(G_t - a) * exp(a - G_s) around the block's mid-decay a; safe while
# the block's total decay stays under this (natural log units, factors below e^42).
SAFE_SPAN = tl.constexpr(84.0) if triton is not None else 84.0


class KdaPlan(NamedTuple):
    """Device metadata of one batch; host counts for the grids."""

    meta: torch.Tensor  # int32, the regions below back to back
    num_decode: int
    num_prefill: int
    num_chunks: int
    max_len: int


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


@functools.lru_cache(maxsize=16)
def _plan(cu_seqlens: tuple[int, ...], state_slots: tuple[int, ...], is_fresh: tuple[bool, ...],
          device: torch.device) -> KdaPlan:
    """Pack [decode: tok, slot, fresh]* [prefill: start, end, slot, fresh, chunk0]* [chunk: start,
    end, seq]* into one int32 tensor."""
    decode, prefill, chunks = [], [], []
    for b, slot in enumerate(state_slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end - start == 1:
            decode += [start, slot, int(is_fresh[b])]
        elif end - start > 1:
            prefill += [start, end, slot, int(is_fresh[b]), len(chunks) // 3]
            for c0 in range(start, end, CHUNK):
                chunks += [c0, end, len(prefill) // 5 - 1]
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(state_slots))]
    meta = torch.tensor(decode + prefill + chunks or [0], dtype=torch.int32).to(device)
    return KdaPlan(meta, len(decode) // 3, len(prefill) // 5, len(chunks) // 3,
                   max(lens, default=0))


def _check_heads(t: torch.Tensor, name: str) -> None:
    assert t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2], (
        f"{name} must be [T, H, D] with contiguous heads, got strides {t.stride()}")


@_jit
def kda_decode_kernel(q, k, v, g, beta, state, o, meta, scale, stride_q, stride_k, stride_v,
                      stride_g, stride_b, stride_o, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One token per sequence: l2norm, decay, delta-rule update and output, state in place."""
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = tl.load(meta + i_b * 3).to(tl.int64)
    slot = tl.load(meta + i_b * 3 + 1).to(tl.int64)
    fresh = tl.load(meta + i_b * 3 + 2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(q + tok * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + tok * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + tok * stride_g + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + tok * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * stride_b + i_h).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    # NOTE: scalar masks are broadcast by hand (the interpreter rejects scalar & tensor).
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV]
    b_s = b_s * tl.exp(b_g)[:, None]
    b_read = tl.sum(b_s * b_k[:, None], 0)  # [BV]
    b_delta = b_beta * (b_v - b_read)
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + tok * stride_o + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@_jit
def _row(x, o_r, r):
    """Row r of a register tile, as a vector over its columns."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), 0)


@_jit
def _diag(b_q, b_k, b_gl, b_tot, PREC: tl.constexpr, BC: tl.constexpr):
    """Aqk (s <= t) and Akk (s < t) inside one sub-chunk; b_gl is its local cumulative decay."""
    o_r = tl.arange(0, BC)
    causal = o_r[:, None] >= o_r[None, :]
    strict = o_r[:, None] > o_r[None, :]
    span = tl.max(-b_tot, 0)
    if span <= SAFE_SPAN:
        b_c = b_gl - 0.5 * b_tot[None, :]
        b_up = tl.exp(b_c)
        b_kt = tl.trans(b_k * tl.exp(-b_c))
        b_aqk = tl.where(causal, tl.dot(b_q * b_up, b_kt, input_precision=PREC), 0.0)
        b_akk = tl.where(strict, tl.dot(b_k * b_up, b_kt, input_precision=PREC), 0.0)
    else:
        # NOTE: steep decays overflow the factored form; fall back to one column at a time.
        b_aqk = tl.zeros([BC, BC], dtype=tl.float32)
        b_akk = tl.zeros([BC, BC], dtype=tl.float32)
        for j in range(BC):
            b_kj = _row(b_k, o_r, j)
            b_gj = _row(b_gl, o_r, j)
            b_e = tl.exp(tl.where(o_r[:, None] >= j, b_gl - b_gj[None, :], float("-inf")))
            b_ke = b_e * b_kj[None, :]
            col_qk = tl.sum(b_q * b_ke, 1)
            col_kk = tl.sum(b_k * b_ke, 1)
            b_aqk = tl.where(o_r[None, :] == j, col_qk[:, None], b_aqk)
            b_akk = tl.where((o_r[None, :] == j) & strict, col_kk[:, None], b_akk)
    return b_aqk, b_akk


@_jit
def _tril_inverse(b_a, BC: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A [BC, BC], by forward substitution."""
    o_r = tl.arange(0, BC)
    eye = tl.where(o_r[:, None] == o_r[None, :], 1.0, 0.0)
    b_t = eye
    for r in range(1, BC):
        b_n = _row(b_a, o_r, r)
        b_tr = tl.where(o_r == r, 1.0, 0.0) - tl.sum(b_n[:, None] * b_t, 0)
        b_t = tl.where(o_r[:, None] == r, b_tr[None, :], b_t)
    return b_t


@_jit
def _store_rows(ptr, b_x, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
                BR: tl.constexpr):
    o_t = t0 + tl.arange(0, BR)
    o_c = tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + col0 + o_c[None, :]
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m)


@_jit
def _load_rows(ptr, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
               BR: tl.constexpr):
    o_t = t0 + tl.arange(0, BR)
    o_c = tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + col0 + o_c[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@_jit
def _l2norm_rows(b_x):
    return b_x / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)[:, None]


@_jit
def _row_block(q, k, g, beta, aqk, t_i, t_end, c_i, i_h, t0, stride_q, stride_k,
               stride_g, stride_b, scale, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
               PREC: tl.constexpr, NJ: tl.constexpr):
    """Rows of sub-chunk NJ: store its Aqk row blocks; return its Akk blocks against sub-chunks
    0..NJ (beta applied; unused ones zero) and beta."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    b_q = _l2norm_rows(_load_rows(q, t_i, t_end, stride_q, i_h * K, K, BK, BC)) * scale
    b_k = _l2norm_rows(_load_rows(k, t_i, t_end, stride_k, i_h * K, K, BK, BC))
    b_g = _load_rows(g, t_i, t_end, stride_g, i_h * K, K, BK, BC)
    o_r = t_i + tl.arange(0, BC)
    b_b = tl.load(beta + o_r.to(tl.int64) * stride_b + i_h, mask=o_r < t_end, other=0.0)
    b_b = b_b.to(tl.float32)
    b_l = tl.cumsum(b_g, 0)
    aq_d, ak_d = _diag(b_q, b_k, b_l, tl.sum(b_g, 0), PREC, BC)
    stride_a = H * BT
    _store_rows(aqk + i_h * BT, aq_d, t_i, t_end, stride_a, NJ * BC, BC, BC, BC)
    ak_0 = tl.zeros([BC, BC], dtype=tl.float32)
    ak_1 = tl.zeros([BC, BC], dtype=tl.float32)
    ak_2 = tl.zeros([BC, BC], dtype=tl.float32)
    if NJ > 0:
        # Earlier sub-chunks j, anchored at the decay c_i carried into this one.
        b_up = tl.exp(b_l)
        b_qu, b_ku = b_q * b_up, b_k * b_up
        c_j = tl.zeros([BK], dtype=tl.float32)
        for j in tl.static_range(NJ):
            t_j = t0 + j * BC
            b_kj = _l2norm_rows(_load_rows(k, t_j, t_end, stride_k, i_h * K, K, BK, BC))
            b_gj = _load_rows(g, t_j, t_end, stride_g, i_h * K, K, BK, BC)
            b_kt = tl.trans(b_kj * tl.exp(c_i[None, :] - c_j[None, :] - tl.cumsum(b_gj, 0)))
            c_j += tl.sum(b_gj, 0)
            aq = tl.dot(b_qu, b_kt, input_precision=PREC)
            ak = tl.dot(b_ku, b_kt, input_precision=PREC) * b_b[:, None]
            _store_rows(aqk + i_h * BT, aq, t_i, t_end, stride_a, j * BC, BC, BC, BC)
            if j == 0:
                ak_0 = ak
            elif j == 1:
                ak_1 = ak
            else:
                ak_2 = ak
    return ak_0, ak_1, ak_2, ak_d * b_b[:, None]


@_jit
def kda_chunk_prep_kernel(q, k, v, g, beta, w, u, qg, kd, aqk, tinv, gl, meta, scale,
                          stride_q, stride_k, stride_v, stride_g, stride_b,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BK: tl.constexpr, BVF: tl.constexpr, PREC: tl.constexpr, PH: tl.constexpr = 3):
    """Intra-chunk part of one (chunk, head). Phase 1, in 16-row sub-chunks: Aqk and
    T = (I + diag(beta) Akk)^-1 (to the tinv scratch). Phase 2, on whole 64-row tiles:
    w = T (beta k exp(G)), u = T (beta v), qg = q exp(G), kd = k exp(G_last - G), exp(G_last)."""
    BC: tl.constexpr = 16
    BT: tl.constexpr = 64
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
    p_t = tinv + i_h * BT
    stride_a = H * BT
    if PH != 2:
        # Decay carried into each sub-chunk (cumulative log-decay before its first row).
        c1 = tl.sum(_load_rows(g, t0, t_end, stride_g, i_h * K, K, BK, BC), 0)
        c2 = c1 + tl.sum(_load_rows(g, t1, t_end, stride_g, i_h * K, K, BK, BC), 0)
        c3 = c2 + tl.sum(_load_rows(g, t2, t_end, stride_g, i_h * K, K, BK, BC), 0)
        strides = stride_q, stride_k, stride_g, stride_b
        c0 = tl.zeros([BK], dtype=tl.float32)
        _, _, _, a00 = _row_block(q, k, g, beta, aqk, t0, t_end, c0, i_h, t0, *strides, scale,
                                  H, K, BK, PREC, 0)
        a10, _, _, a11 = _row_block(q, k, g, beta, aqk, t1, t_end, c1, i_h, t0, *strides, scale,
                                    H, K, BK, PREC, 1)
        a20, a21, _, a22 = _row_block(q, k, g, beta, aqk, t2, t_end, c2, i_h, t0, *strides, scale,
                                      H, K, BK, PREC, 2)
        a30, a31, a32, a33 = _row_block(q, k, g, beta, aqk, t3, t_end, c3, i_h, t0, *strides,
                                        scale, H, K, BK, PREC, 3)
        # T by blocks: invert the diagonal blocks, then T_ij = -T_ii sum_{j <= m < i} A_im T_mj.
        t00 = _tril_inverse(a00, BC)
        t11 = _tril_inverse(a11, BC)
        t22 = _tril_inverse(a22, BC)
        t33 = _tril_inverse(a33, BC)
        t10 = -tl.dot(t11, tl.dot(a10, t00, input_precision=PREC), input_precision=PREC)
        t21 = -tl.dot(t22, tl.dot(a21, t11, input_precision=PREC), input_precision=PREC)
        t20 = -tl.dot(t22, tl.dot(a20, t00, input_precision=PREC)
                      + tl.dot(a21, t10, input_precision=PREC), input_precision=PREC)
        t32 = -tl.dot(t33, tl.dot(a32, t22, input_precision=PREC), input_precision=PREC)
        t31 = -tl.dot(t33, tl.dot(a31, t11, input_precision=PREC)
                      + tl.dot(a32, t21, input_precision=PREC), input_precision=PREC)
        t30 = -tl.dot(t33, tl.dot(a30, t00, input_precision=PREC)
                      + tl.dot(a31, t10, input_precision=PREC)
                      + tl.dot(a32, t20, input_precision=PREC), input_precision=PREC)
        p_t = tinv + i_h * BT
        stride_a = H * BT
        _store_rows(p_t, t00, t0, t_end, stride_a, 0, BC, BC, BC)
        _store_rows(p_t, t10, t1, t_end, stride_a, 0, BC, BC, BC)
        _store_rows(p_t, t11, t1, t_end, stride_a, BC, BC, BC, BC)
        _store_rows(p_t, t20, t2, t_end, stride_a, 0, BC, BC, BC)
        _store_rows(p_t, t21, t2, t_end, stride_a, BC, BC, BC, BC)
        _store_rows(p_t, t22, t2, t_end, stride_a, 2 * BC, BC, BC, BC)
        _store_rows(p_t, t30, t3, t_end, stride_a, 0, BC, BC, BC)
        _store_rows(p_t, t31, t3, t_end, stride_a, BC, BC, BC, BC)
        _store_rows(p_t, t32, t3, t_end, stride_a, 2 * BC, BC, BC, BC)
        _store_rows(p_t, t33, t3, t_end, stride_a, 3 * BC, BC, BC, BC)
    # NOTE: phase 2 reads T back as one tile; the barrier orders this CTA's global writes.
    tl.debug_barrier()
    if PH == 1:
        return
    dt = w.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    b_g = _load_rows(g, t0, t_end, stride_g, i_h * K, K, BK, BT)
    b_G = tl.cumsum(b_g, 0)  # [BT, BK]
    b_last = tl.sum(b_g, 0)
    b_q = _l2norm_rows(_load_rows(q, t0, t_end, stride_q, i_h * K, K, BK, BT)) * scale
    _store_rows(qg, b_q * tl.exp(b_G), t0, t_end, H * K, i_h * K, K, BK, BT)
    b_k = _l2norm_rows(_load_rows(k, t0, t_end, stride_k, i_h * K, K, BK, BT))
    _store_rows(kd, b_k * tl.exp(b_last[None, :] - b_G), t0, t_end, H * K, i_h * K, K, BK, BT)
    tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp(b_last), mask=o_k < K)
    o_r = t0 + o_t
    b_b = tl.load(beta + o_r.to(tl.int64) * stride_b + i_h, mask=o_r < t_end, other=0.0)
    b_b = b_b.to(tl.float32)
    m_tt = (o_r < t_end)[:, None] & (o_t[None, :] // BC <= o_t[:, None] // BC)
    b_t = tl.load(p_t + o_r.to(tl.int64)[:, None] * stride_a + o_t[None, :], mask=m_tt,
                  other=0.0).to(dt)  # [BT, BT]
    b_kb = (b_k * tl.exp(b_G) * b_b[:, None]).to(dt)
    _store_rows(w, tl.dot(b_t, b_kb, input_precision=PREC), t0, t_end, H * K, i_h * K, K, BK,
                BT)
    b_vb = (_load_rows(v, t0, t_end, stride_v, i_h * V, V, BVF, BT) * b_b[:, None]).to(dt)
    _store_rows(u, tl.dot(b_t, b_vb, input_precision=PREC), t0, t_end, H * V, i_h * V, V, BVF,
                BT)


@_jit
def kda_chunk_state_kernel(w, u, qg, kd, aqk, gl, state, o, meta, stride_o,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """Walk one sequence's chunks for one (head, value block): v' = u - w S, output
    o = qg S + Aqk v', then S <- exp(G_last) S + kd^T v'. Initial and final S in the slot."""
    BT: tl.constexpr = 64
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(meta + i_n * 5)
    end = tl.load(meta + i_n * 5 + 1)
    slot = tl.load(meta + i_n * 5 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 5 + 3)
    chunk0 = tl.load(meta + i_n * 5 + 4)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32
    dt = w.dtype.element_ty
    num_chunks = tl.cdiv(end - start, BT)
    for i_c in tl.range(num_chunks, num_stages=2):
        rows = start + i_c * BT + o_t
        m_t = rows < end
        rows = rows.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_x = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_x, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + p_x, mask=m_tk, other=0.0)
        b_kd = tl.load(kd + p_x, mask=m_tk, other=0.0)
        b_u = tl.load(u + rows[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        m_a = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
        b_a = tl.load(aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_a,
                      other=0.0)
        b_gl = tl.load(gl + ((chunk0 + i_c) * H + i_h).to(tl.int64) * K + o_k, mask=m_k,
                       other=0.0)
        b_sd = b_s.to(dt)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w, b_sd, input_precision=PREC)  # [BT, BV]
        b_vnd = b_vn.to(dt)
        b_o = tl.dot(b_qg, b_sd, input_precision=PREC)
        b_o = tl.dot(b_a, b_vnd, b_o, input_precision=PREC)
        tl.store(o + rows[:, None] * stride_o + i_h * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_gl[:, None] + tl.dot(tl.trans(b_kd), b_vnd, input_precision=PREC)
    tl.store(p_s, b_s, mask=m_s)


def _prec(dtype: torch.dtype) -> str:
    # fp32 models keep fp32 products (TF32 would cost ~1e-3); bf16 models round like fla does.
    return "ieee" if dtype == torch.float32 else "tf32"


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool],
        *, chunk_size: int = 64) -> torch.Tensor:
    """Triton `kda_ref`: decode sequences take the fused recurrent kernel, longer ones the
    chunked pair (prep, then the sequential state walk). `chunk_size` is accepted for
    signature parity; the kernels use 64."""
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        _check_heads(t, name)
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    assert k.shape == q.shape and g.shape == q.shape and v.shape[:2] == q.shape[:2]
    assert beta.shape == (num_tokens, heads) and beta.stride(1) == 1
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert state.shape[1:] == (heads, dk, dv)
    assert len(cu_seqlens) == len(state_slots) + 1 == len(is_fresh) + 1
    out = torch.empty(num_tokens, heads, dv, dtype=q.dtype, device=q.device)
    plan = _plan(tuple(cu_seqlens), tuple(state_slots), tuple(bool(f) for f in is_fresh),
                 q.device)
    scale = dk ** -0.5
    bk = triton.next_power_of_2(dk)
    strides = (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0))
    if plan.num_decode:
        bv = min(32, triton.next_power_of_2(dv))
        grid = (plan.num_decode, heads, triton.cdiv(dv, bv))
        kda_decode_kernel[grid](q, k, v, g, beta, state, out, plan.meta, scale, *strides,
                                out.stride(0), H=heads, K=dk, V=dv, BK=bk, BV=bv, num_warps=4)
    if plan.num_prefill:
        _prefill(q, k, v, g, beta, state, out, plan, scale, strides)
    return out


def _prefill(q, k, v, g, beta, state, out, plan: KdaPlan, scale: float, strides) -> None:
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    bk, bvf = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    assert bk >= 16 and bvf >= 16, "head dims below 16 do not fit tl.dot"
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    w = torch.empty(num_tokens, heads, dk, dtype=dt, device=q.device)
    qg, kd = torch.empty_like(w), torch.empty_like(w)
    u = torch.empty(num_tokens, heads, dv, dtype=dt, device=q.device)
    aqk = torch.empty(num_tokens, heads, CHUNK, dtype=dt, device=q.device)
    tinv = torch.empty_like(aqk)
    gl = torch.empty(plan.num_chunks, heads, dk, dtype=torch.float32, device=q.device)
    prec = _prec(q.dtype)
    chunk_meta = plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]
    seq_meta = plan.meta[plan.num_decode * 3:]
    kda_chunk_prep_kernel[(plan.num_chunks, heads)](
        q, k, v, g, beta, w, u, qg, kd, aqk, tinv, gl, chunk_meta, scale, *strides,
        H=heads, K=dk, V=dv, BK=bk, BVF=bvf, PREC=prec, num_warps=8)
    bv = min(32, bvf)
    kda_chunk_state_kernel[(plan.num_prefill, heads, triton.cdiv(dv, bv))](
        w, u, qg, kd, aqk, gl, state, out, seq_meta, out.stride(0),
        H=heads, K=dk, V=dv, BK=bk, BV=bv, PREC=prec, num_warps=4, num_stages=2)


@_jit
def causal_conv1d_kernel(x, weight, conv_state, out, meta, stride_x, stride_o, C,
                         HIST: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, WRITE_STATE: tl.constexpr):
    """Depthwise causal conv + SiLU over one (token block of one sequence, channel block).
    History comes from the slot (zeros if fresh); with WRITE_STATE the block holds its whole
    sequence and also stores the new history."""
    i_blk, i_c = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_blk * 5)
    start = tl.load(meta + i_blk * 5 + 1)
    end = tl.load(meta + i_blk * 5 + 2)
    slot = tl.load(meta + i_blk * 5 + 3).to(tl.int64)
    fresh = tl.load(meta + i_blk * 5 + 4)
    o_t = t0 + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_t = o_t < end
    p_hist = conv_state + (slot * C + o_c) * HIST
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(HIST + 1):
        # Input at position t - HIST + j: a token of this sequence, or history column HIST + src.
        src = o_t - HIST + j
        in_seq = src >= start
        b_x = tl.load(x + src.to(tl.int64)[:, None] * stride_x + o_c[None, :],
                      mask=(in_seq & m_t)[:, None] & m_c[None, :], other=0.0)
        hcol = HIST + src - start
        m_h = (~in_seq & m_t & ((src * 0 + fresh) == 0))[:, None] & m_c[None, :]
        b_h = tl.load(p_hist[None, :] + hcol[:, None], mask=m_h, other=0.0).to(x.dtype.element_ty)
        b_w = tl.load(weight + o_c * (HIST + 1) + j, mask=m_c, other=0.0)
        b_acc += (b_x.to(tl.float32) + b_h.to(tl.float32)) * b_w[None, :]
    b_out = b_acc / (1.0 + tl.exp(-b_acc))
    tl.store(out + o_t.to(tl.int64)[:, None] * stride_o + o_c[None, :],
             b_out.to(out.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if WRITE_STATE:
        _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, m_c, HIST,
                           HP)


@_jit
def _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, m_c,
                       HIST: tl.constexpr, HP: tl.constexpr):
    """New history = the last HIST entries of [old history | tokens]; all loads before stores."""
    o_j = tl.arange(0, HP)
    m_j = o_j < HIST
    pos = end - HIST + o_j  # [HP] absolute token index of each new column
    in_seq = pos >= start
    m_x = (in_seq & m_j)[None, :] & m_c[:, None]
    b_x = tl.load(x + pos.to(tl.int64)[None, :] * stride_x + o_c[:, None], mask=m_x, other=0.0)
    p_hist = conv_state + (slot * C + o_c)[:, None] * HIST
    hcol = HIST + pos - start
    m_h = (~in_seq & m_j & ((pos * 0 + fresh) == 0))[None, :] & m_c[:, None]
    b_h = tl.load(p_hist + hcol[None, :], mask=m_h, other=0.0)
    b_new = tl.where(in_seq[None, :], b_x.to(conv_state.dtype.element_ty), b_h)
    tl.store(p_hist + o_j[None, :], b_new, mask=m_c[:, None] & m_j[None, :])


@_jit
def causal_conv1d_state_kernel(x, conv_state, meta, stride_x, C, HIST: tl.constexpr,
                               HP: tl.constexpr, BC: tl.constexpr):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    start = tl.load(meta + i_n * 4)
    end = tl.load(meta + i_n * 4 + 1)
    slot = tl.load(meta + i_n * 4 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 4 + 3)
    o_c = i_c * BC + tl.arange(0, BC)
    _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, o_c < C, HIST,
                       HP)


@functools.lru_cache(maxsize=16)
def _conv_plan(cu_seqlens: tuple[int, ...], state_slots: tuple[int, ...],
               is_fresh: tuple[bool, ...], block: int, device: torch.device
               ) -> tuple[torch.Tensor, int, int]:
    """[block: t0, start, end, slot, fresh]* then [seq: start, end, slot, fresh]*, as int32."""
    blocks, seqs = [], []
    for b, slot in enumerate(state_slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        seqs += [start, end, slot, int(is_fresh[b])]
        for t0 in range(start, end, block):
            blocks += [t0, start, end, slot, int(is_fresh[b])]
    meta = torch.tensor(blocks + seqs or [0], dtype=torch.int32).to(device)
    return meta, len(blocks) // 5, len(seqs) // 4


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool]
                  ) -> torch.Tensor:
    """Triton `causal_conv1d_ref`: x `[T, C]`, weight `[C, K]` fp32, conv_state `[S, C, K-1]`."""
    num_tokens, channels = x.shape
    hist = weight.shape[1] - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert conv_state.shape[1:] == (channels, hist) and hist >= 1
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(state_slots))]
    max_len = max(lens, default=0)
    block = min(64, triton.next_power_of_2(max(max_len, 1)))
    meta, num_blocks, num_seqs = _conv_plan(tuple(cu_seqlens), tuple(state_slots),
                                            tuple(bool(f) for f in is_fresh), block, x.device)
    if num_seqs == 0:
        return out
    bc = 256 if block <= 16 else 128
    fused = max_len <= block and min(lens) >= 1
    grid_c = triton.cdiv(channels, bc)
    if num_blocks:
        causal_conv1d_kernel[(num_blocks, grid_c)](
            x, weight, conv_state, out, meta, x.stride(0), out.stride(0), channels,
            HIST=hist, HP=triton.next_power_of_2(hist), BT=block, BC=bc, WRITE_STATE=fused,
            num_warps=4)
    if not fused:
        causal_conv1d_state_kernel[(num_seqs, grid_c)](
            x, conv_state, meta[num_blocks * 5:], x.stride(0), channels, HIST=hist,
            HP=triton.next_power_of_2(hist), BC=bc, num_warps=4)
    return out


__all__ = ["causal_conv1d", "kda"]
