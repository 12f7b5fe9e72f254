"""Triton KDA chunked prefill in fla's stages (README.md, "The staged form"): gate cumsum and
norms, intra-chunk products and inverse, w/u, state walk and, split off or fused into the walk,
the output. Each stage is one kernel with its own launch shape (`StagedConfig`), so the stages
are timed one by one; the fused prep of chunk_triton.py computes the same buffers in one kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.kda.chunk_triton import (
    CHUNK,
    RCP_LN2,
    SAFE_SPAN,
    PrefillBuffers,
    _load_rows,
    _store_rows,
    _upper_inverse_blocks,
    launch_state,
)
from glmflash.kernels.triton_utils import dot_operand_type, jit, product_precision

if TYPE_CHECKING:
    from glmflash.kernels.kda.triton_impl import KdaConfig, KdaPlan


@dataclass(frozen=True)
class StagedConfig:
    """Launch shapes of the staged prefill (bench/kda_prefill.py sweeps them)."""

    gate_warps: int = 4
    intra_warps: int = 2
    intra_key_block: int = 32
    """Channels per step of the intra-chunk products."""
    inverse_bf16: bool = True
    """Store (I + diag(beta) Akk)^-1 in bf16 and take w, u as bf16 products (fla's choice) for
    16-bit models; else fp32 and TF32 products."""
    wy_warps: int = 4
    wy_block: int = 64
    """Channels (and value columns) per step of the w/u kernel."""
    split_output: bool = False
    """The walk stores the state per chunk and a parallel kernel computes the output (fla's
    form); else the walk computes the output as it goes (KdaConfig's state walk)."""
    out_warps: int = 4
    out_value_block: int = 64


class StagedBuffers(NamedTuple):
    """The stages' intermediates: cumulative decay (log2) per token, head and channel, the
    inverse norms of q (times the scale) and k per token and head, the inverse T, and what the
    walk reads (chunk_triton.PrefillBuffers)."""

    g2: torch.Tensor
    rq: torch.Tensor
    rk: torch.Tensor
    tinv: torch.Tensor
    walk: PrefillBuffers


@jit
def kda_gate_kernel(q, k, g, g2, rq, rk, meta, scale, stride_q, stride_k, stride_g,
                    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """One (chunk, head): the decay's cumulative sum from the chunk start in log2 units, and
    scale / |q| and 1 / |k| per row (eps inside the root, as the reference)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    b_nq = tl.zeros([64], dtype=tl.float32)
    b_nk = b_nq
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_g = _load_rows(g + i_h * K, t0, t_end, stride_g, c0, K, BK, 64) * RCP_LN2
        _store_rows(g2 + i_h * K, tl.cumsum(b_g, 0), t0, t_end, H * K, c0, K, BK, 64)
        b_q = _load_rows(q + i_h * K, t0, t_end, stride_q, c0, K, BK, 64)
        b_k = _load_rows(k + i_h * K, t0, t_end, stride_k, c0, K, BK, 64)
        b_nq += tl.sum(b_q * b_q, 1)
        b_nk += tl.sum(b_k * b_k, 1)
    o_t = t0 + tl.arange(0, 64)
    p = o_t.to(tl.int64) * H + i_h
    tl.store(rq + p, scale / tl.sqrt(b_nq + 1e-6), mask=o_t < t_end)
    tl.store(rk + p, 1.0 / tl.sqrt(b_nk + 1e-6), mask=o_t < t_end)


@jit
def _g_row(g2, r, t_end, c0, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Row r of the cumulative decay (channels c0..c0 + BK), r clamped to the last row."""
    o_k = c0 + tl.arange(0, BK)
    r = tl.minimum(r, t_end - 1).to(tl.int64)
    return tl.load(g2 + r * (H * K) + o_k, mask=o_k < K, other=0.0)


@jit
def _row_vec(x, r0, t_end, stride):
    """x[r0:r0 + 16] of a per-(token, head) vector already offset to the head, 0 past t_end."""
    o_t = r0 + tl.arange(0, 16)
    return tl.load(x + o_t.to(tl.int64) * stride, mask=o_t < t_end, other=0.0).to(tl.float32)


@jit
def _diag_block(b_aq, b_ut, b_q, b_k, b_g, b_first, b_last, m_r, PREC: tl.constexpr):
    """Adds one channel block's share of the diagonal block of a sub-chunk: Aqk (rows x keys)
    and Akk^T (keys x rows). Each channel is anchored at its middle decay across the
    sub-chunk, so both factors stay within 2^(span / 2); channels steeper than SAFE_SPAN are
    left out (`_steep_diag`)."""
    b_mid = 0.5 * (b_first + b_last)
    m = m_r[:, None] & (b_first - b_last <= SAFE_SPAN)[None, :]
    b_up = tl.where(m, tl.exp2(b_g - b_mid[None, :]), 0.0)
    b_kd = b_k * tl.where(m, tl.exp2(b_mid[None, :] - b_g), 0.0)
    b_aq = tl.dot(b_q * b_up, tl.trans(b_kd), b_aq, input_precision=PREC)
    b_ut = tl.dot(b_kd, tl.trans(b_k * b_up), b_ut, input_precision=PREC)
    return b_aq, b_ut


@jit
def _off_block(b_aq, b_ut, b_qa, b_ka, b_gn, b_k, b_g, m_r, PREC: tl.constexpr):
    """Adds one channel block's share of the block (rows of sub-chunk i, keys of j < i):
    b_qa, b_ka are i's q and k times exp2(G - gn), gn the decay at i's first row; the keys
    take exp2(gn - G). Both factors are <= 1 for any gate."""
    b_kb = b_k * tl.where(m_r[:, None], tl.exp2(b_gn[None, :] - b_g), 0.0)
    b_aq = tl.dot(b_qa, tl.trans(b_kb), b_aq, input_precision=PREC)
    b_ut = tl.dot(b_kb, tl.trans(b_ka), b_ut, input_precision=PREC)
    return b_aq, b_ut


@jit
def _steep_diag(q, k, g2, r0, t_end, stride_q, stride_k, H: tl.constexpr, K: tl.constexpr,
                BK: tl.constexpr):
    """The steep channels' (span > SAFE_SPAN) share of a sub-chunk's diagonal block, Aqk and
    Akk^T, with exact decays exp2(G_t - G_s), one key at a time (rows reloaded from memory)."""
    o_i = tl.arange(0, 16)
    m_r = r0 + o_i < t_end
    b_xq = tl.zeros([16, 16], dtype=tl.float32)
    b_xk = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        o_k = c0 + tl.arange(0, BK)
        b_q = _load_rows(q, r0, t_end, stride_q, c0, K, BK, 16)
        b_k = _load_rows(k, r0, t_end, stride_k, c0, K, BK, 16)
        b_g = _load_rows(g2, r0, t_end, H * K, c0, K, BK, 16)
        b_steep = (_g_row(g2, r0, t_end, c0, H, K, BK) - _g_row(g2, r0 + 15, t_end, c0, H, K, BK)
                   ) > SAFE_SPAN
        for c in range(16):
            m_c = (o_k < K) & (o_k * 0 + r0 + c < t_end)
            b_kc = tl.load(k + (r0 + c).to(tl.int64) * stride_k + o_k, mask=m_c, other=0.0)
            b_gc = tl.load(g2 + (r0 + c).to(tl.int64) * (H * K) + o_k, mask=m_c, other=0.0)
            m = (m_r & (o_i >= c))[:, None] & b_steep[None, :]
            b_d = tl.exp2(tl.where(m, b_g - b_gc[None, :], float("-inf")))
            b_d = b_d * b_kc.to(tl.float32)[None, :]
            b_xq = tl.where(o_i[None, :] == c, b_xq + tl.sum(b_q * b_d, 1)[:, None], b_xq)
            b_xk = tl.where(o_i[:, None] == c, b_xk + tl.sum(b_k * b_d, 1)[None, :], b_xk)
    return b_xq, b_xk


@jit
def _store_block(ptr, b_x, r0, col0, t_end, stride, TRANS: tl.constexpr):
    """Stores a 16x16 block at rows r0.., columns col0.. (its transpose with TRANS), rows past
    t_end left alone."""
    o_a = tl.arange(0, 16)
    if TRANS:
        rows, cols = r0 + o_a[None, :], col0 + o_a[:, None]
    else:
        rows, cols = r0 + o_a[:, None], col0 + o_a[None, :]
    tl.store(ptr + rows.to(tl.int64) * stride + cols, b_x.to(ptr.dtype.element_ty),
             mask=rows < t_end)


@jit
def _store_aqk_block(aqk, b_a, b_rq, b_rk, r0, col0, t_end, H: tl.constexpr,
                     DIAG: tl.constexpr):
    b_a = b_a * b_rq[:, None] * b_rk[None, :]
    if DIAG:
        o_i = tl.arange(0, 16)
        b_a = tl.where(o_i[:, None] >= o_i[None, :], b_a, 0.0)
    _store_block(aqk, b_a, r0, col0, t_end, H * 64, False)


@jit
def _upper_block(b_ut, b_rk_keys, b_row, DIAG: tl.constexpr):
    """U_ji = (diag(beta) Akk)^T_ji from Akk^T (unnormalised); strictly upper on the diagonal."""
    b_u = b_ut * b_rk_keys[:, None] * b_row[None, :]
    if DIAG:
        o_i = tl.arange(0, 16)
        b_u = tl.where(o_i[:, None] < o_i[None, :], b_u, 0.0)
    return b_u


@jit
def kda_intra_kernel(q, k, g2, rq, rk, beta, aqk, tinv, meta, stride_q, stride_k, stride_b,
                     H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                     SOLVE: tl.constexpr):
    """One (chunk, head): Aqk (scaled, normalised, causal) and T = (I + diag(beta) Akk)^-1 from
    16x16 blocks: the four diagonal ones anchored at each sub-chunk's middle decay, the six
    below anchored at the row sub-chunk's first row; the inverse from the 16x16 blocks of
    U = (diag(beta) Akk)^T (chunk_triton._upper_inverse_blocks), stored transposed as T."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    q += i_h * K
    k += i_h * K
    g2 += i_h * K
    r1, r2, r3 = t0 + 16, t0 + 32, t0 + 48
    o_i = tl.arange(0, 16)
    m0, m1, m2, m3 = t0 + o_i < t_end, r1 + o_i < t_end, r2 + o_i < t_end, r3 + o_i < t_end
    z = tl.zeros([16, 16], dtype=tl.float32)
    a00, a11, a22, a33, u00, u11, u22, u33 = z, z, z, z, z, z, z, z
    a10, a20, a21, a30, a31, a32 = z, z, z, z, z, z
    u01, u02, u12, u03, u13, u23 = z, z, z, z, z, z
    b_span = 0.0
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_q0 = _load_rows(q, t0, t_end, stride_q, c0, K, BK, 16)
        b_k0 = _load_rows(k, t0, t_end, stride_k, c0, K, BK, 16)
        b_g0 = _load_rows(g2, t0, t_end, H * K, c0, K, BK, 16)
        b_q1 = _load_rows(q, r1, t_end, stride_q, c0, K, BK, 16)
        b_k1 = _load_rows(k, r1, t_end, stride_k, c0, K, BK, 16)
        b_g1 = _load_rows(g2, r1, t_end, H * K, c0, K, BK, 16)
        b_q2 = _load_rows(q, r2, t_end, stride_q, c0, K, BK, 16)
        b_k2 = _load_rows(k, r2, t_end, stride_k, c0, K, BK, 16)
        b_g2 = _load_rows(g2, r2, t_end, H * K, c0, K, BK, 16)
        b_q3 = _load_rows(q, r3, t_end, stride_q, c0, K, BK, 16)
        b_k3 = _load_rows(k, r3, t_end, stride_k, c0, K, BK, 16)
        b_g3 = _load_rows(g2, r3, t_end, H * K, c0, K, BK, 16)
        # each sub-chunk's first and last decay (rows clamped to the chunk's last)
        b_f0, b_l0 = _g_row(g2, t0, t_end, c0, H, K, BK), _g_row(g2, t0 + 15, t_end, c0, H, K, BK)
        b_f1, b_l1 = _g_row(g2, r1, t_end, c0, H, K, BK), _g_row(g2, r1 + 15, t_end, c0, H, K, BK)
        b_f2, b_l2 = _g_row(g2, r2, t_end, c0, H, K, BK), _g_row(g2, r2 + 15, t_end, c0, H, K, BK)
        b_f3, b_l3 = _g_row(g2, r3, t_end, c0, H, K, BK), _g_row(g2, r3 + 15, t_end, c0, H, K, BK)
        b_s = tl.maximum(tl.maximum(b_f0 - b_l0, b_f1 - b_l1), tl.maximum(b_f2 - b_l2, b_f3 - b_l3))
        b_span = tl.maximum(b_span, tl.max(b_s, 0))
        a00, u00 = _diag_block(a00, u00, b_q0, b_k0, b_g0, b_f0, b_l0, m0, PREC)
        a11, u11 = _diag_block(a11, u11, b_q1, b_k1, b_g1, b_f1, b_l1, m1, PREC)
        a22, u22 = _diag_block(a22, u22, b_q2, b_k2, b_g2, b_f2, b_l2, m2, PREC)
        a33, u33 = _diag_block(a33, u33, b_q3, b_k3, b_g3, b_f3, b_l3, m3, PREC)
        # rows of sub-chunk i times exp2(G - G_first(i)), then each earlier sub-chunk's keys
        b_x = tl.where(m1[:, None], tl.exp2(b_g1 - b_f1[None, :]), 0.0)
        a10, u01 = _off_block(a10, u01, b_q1 * b_x, b_k1 * b_x, b_f1, b_k0, b_g0, m0, PREC)
        b_x = tl.where(m2[:, None], tl.exp2(b_g2 - b_f2[None, :]), 0.0)
        b_qa, b_ka = b_q2 * b_x, b_k2 * b_x
        a20, u02 = _off_block(a20, u02, b_qa, b_ka, b_f2, b_k0, b_g0, m0, PREC)
        a21, u12 = _off_block(a21, u12, b_qa, b_ka, b_f2, b_k1, b_g1, m1, PREC)
        b_x = tl.where(m3[:, None], tl.exp2(b_g3 - b_f3[None, :]), 0.0)
        b_qa, b_ka = b_q3 * b_x, b_k3 * b_x
        a30, u03 = _off_block(a30, u03, b_qa, b_ka, b_f3, b_k0, b_g0, m0, PREC)
        a31, u13 = _off_block(a31, u13, b_qa, b_ka, b_f3, b_k1, b_g1, m1, PREC)
        a32, u23 = _off_block(a32, u23, b_qa, b_ka, b_f3, b_k2, b_g2, m2, PREC)
    if b_span > SAFE_SPAN:
        b_xq, b_xk = _steep_diag(q, k, g2, t0, t_end, stride_q, stride_k, H, K, BK)
        a00, u00 = a00 + b_xq, u00 + b_xk
        b_xq, b_xk = _steep_diag(q, k, g2, r1, t_end, stride_q, stride_k, H, K, BK)
        a11, u11 = a11 + b_xq, u11 + b_xk
        b_xq, b_xk = _steep_diag(q, k, g2, r2, t_end, stride_q, stride_k, H, K, BK)
        a22, u22 = a22 + b_xq, u22 + b_xk
        b_xq, b_xk = _steep_diag(q, k, g2, r3, t_end, stride_q, stride_k, H, K, BK)
        a33, u33 = a33 + b_xq, u33 + b_xk
    rq += i_h
    rk += i_h
    b_rq0, b_rk0 = _row_vec(rq, t0, t_end, H), _row_vec(rk, t0, t_end, H)
    b_rq1, b_rk1 = _row_vec(rq, r1, t_end, H), _row_vec(rk, r1, t_end, H)
    b_rq2, b_rk2 = _row_vec(rq, r2, t_end, H), _row_vec(rk, r2, t_end, H)
    b_rq3, b_rk3 = _row_vec(rq, r3, t_end, H), _row_vec(rk, r3, t_end, H)
    aqk += i_h * 64
    _store_aqk_block(aqk, a00, b_rq0, b_rk0, t0, 0, t_end, H, True)
    _store_aqk_block(aqk, a10, b_rq1, b_rk0, r1, 0, t_end, H, False)
    _store_aqk_block(aqk, a11, b_rq1, b_rk1, r1, 16, t_end, H, True)
    _store_aqk_block(aqk, a20, b_rq2, b_rk0, r2, 0, t_end, H, False)
    _store_aqk_block(aqk, a21, b_rq2, b_rk1, r2, 16, t_end, H, False)
    _store_aqk_block(aqk, a22, b_rq2, b_rk2, r2, 32, t_end, H, True)
    _store_aqk_block(aqk, a30, b_rq3, b_rk0, r3, 0, t_end, H, False)
    _store_aqk_block(aqk, a31, b_rq3, b_rk1, r3, 16, t_end, H, False)
    _store_aqk_block(aqk, a32, b_rq3, b_rk2, r3, 32, t_end, H, False)
    _store_aqk_block(aqk, a33, b_rq3, b_rk3, r3, 48, t_end, H, True)
    beta += i_h
    b_row0 = _row_vec(beta, t0, t_end, stride_b) * b_rk0
    b_row1 = _row_vec(beta, r1, t_end, stride_b) * b_rk1
    b_row2 = _row_vec(beta, r2, t_end, stride_b) * b_rk2
    b_row3 = _row_vec(beta, r3, t_end, stride_b) * b_rk3
    v00, v01, v02, v03, v11, v12, v13, v22, v23, v33 = _upper_inverse_blocks(
        _upper_block(u00, b_rk0, b_row0, True), _upper_block(u01, b_rk0, b_row1, False),
        _upper_block(u02, b_rk0, b_row2, False), _upper_block(u03, b_rk0, b_row3, False),
        _upper_block(u11, b_rk1, b_row1, True), _upper_block(u12, b_rk1, b_row2, False),
        _upper_block(u13, b_rk1, b_row3, False), _upper_block(u22, b_rk2, b_row2, True),
        _upper_block(u23, b_rk2, b_row3, False), _upper_block(u33, b_rk3, b_row3, True), SOLVE)
    # T = V^T: block T_ij = (V_ji)^T at rows of sub-chunk i, columns of j
    tinv += i_h * 64
    _store_block(tinv, v00, t0, 0, t_end, H * 64, True)
    _store_block(tinv, v01, r1, 0, t_end, H * 64, True)
    _store_block(tinv, v11, r1, 16, t_end, H * 64, True)
    _store_block(tinv, v02, r2, 0, t_end, H * 64, True)
    _store_block(tinv, v12, r2, 16, t_end, H * 64, True)
    _store_block(tinv, v22, r2, 32, t_end, H * 64, True)
    _store_block(tinv, v03, r3, 0, t_end, H * 64, True)
    _store_block(tinv, v13, r3, 16, t_end, H * 64, True)
    _store_block(tinv, v23, r3, 32, t_end, H * 64, True)
    _store_block(tinv, v33, r3, 48, t_end, H * 64, True)


@jit
def kda_wy_kernel(q, k, v, g2, rq, rk, beta, tinv, w, u, qg, kd, gl, meta, stride_q, stride_k,
                  stride_v, stride_b, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                  STORE_QG: tl.constexpr):
    """One (chunk, head): w = T (beta k exp(G)), u = T (beta v), kd = k exp(G_last - G) and
    exp(G_last) for the walk, and qg = q exp(G) when the walk computes the output (k, q
    normalised, q scaled)."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    rows = t0 + o_t
    m_t = rows < t_end
    rows = rows.to(tl.int64)
    m_a = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_t = tl.load(tinv + rows[:, None] * (H * 64) + i_h * 64 + o_t[None, :], mask=m_a,
                  other=0.0).to(DOT)
    b_b = tl.load(beta + rows * stride_b + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_rk = tl.load(rk + rows * H + i_h, mask=m_t, other=0.0)
    b_rq = tl.load(rq + rows * H + i_h, mask=m_t, other=0.0)
    g2 += i_h * K
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        o_k = c0 + tl.arange(0, BK)
        b_g = _load_rows(g2, t0, t_end, H * K, c0, K, BK, 64)
        b_gl = _g_row(g2, t0 + 63, t_end, c0, H, K, BK)
        tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp2(b_gl), mask=o_k < K)
        b_k = _load_rows(k + i_h * K, t0, t_end, stride_k, c0, K, BK, 64) * b_rk[:, None]
        _store_rows(kd + i_h * K, b_k * tl.exp2(b_gl[None, :] - b_g), t0, t_end, H * K, c0, K,
                    BK, 64)
        b_x = b_k * tl.exp2(b_g) * b_b[:, None]
        b_w = tl.dot(b_t, b_x.to(DOT), input_precision=PREC)
        _store_rows(w + i_h * K, b_w, t0, t_end, H * K, c0, K, BK, 64)
        if STORE_QG:
            b_q = _load_rows(q + i_h * K, t0, t_end, stride_q, c0, K, BK, 64) * b_rq[:, None]
            _store_rows(qg + i_h * K, b_q * tl.exp2(b_g), t0, t_end, H * K, c0, K, BK, 64)
    for i_v in range(tl.cdiv(V, BV)):
        c0 = i_v * BV
        b_x = _load_rows(v + i_h * V, t0, t_end, stride_v, c0, V, BV, 64) * b_b[:, None]
        b_u = tl.dot(b_t, b_x.to(DOT), input_precision=PREC)
        _store_rows(u + i_h * V, b_u, t0, t_end, H * V, c0, V, BV, 64)


@jit
def kda_walk_h_kernel(w, u, kd, gl, state, h, vn, meta, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                      DOT: tl.constexpr):
    """Walk one sequence's chunks for one (head, value block), storing the state each chunk
    starts from (h) and v' = u - w S; S <- exp(G_last) S + kd^T v'. The output is left to
    `kda_output_kernel`."""
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
    # NOTE: scalar masks are broadcast by hand (the interpreter rejects scalar & tensor).
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32
    num_chunks = tl.cdiv(end - start, BT)
    for i_c in tl.range(num_chunks, num_stages=2):
        rows = start + i_c * BT + o_t
        m_t = rows < end
        rows = rows.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_h = h + ((chunk0 + i_c) * H + i_h).to(tl.int64) * (K * V)
        tl.store(p_h + o_k[:, None] * V + o_v[None, :], b_s.to(h.dtype.element_ty), mask=m_s)
        p_x = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_x, mask=m_tk, other=0.0)
        b_kd = tl.load(kd + p_x, mask=m_tk, other=0.0)
        p_v = rows[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_u = tl.load(u + p_v, mask=m_tv, other=0.0)
        b_gl = tl.load(gl + ((chunk0 + i_c) * H + i_h).to(tl.int64) * K + o_k, mask=m_k,
                       other=0.0)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(DOT), b_s.to(DOT), input_precision=PREC)
        b_vnd = b_vn.to(DOT)
        tl.store(vn + p_v, b_vnd.to(vn.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_gl[:, None] + tl.dot(tl.trans(b_kd.to(DOT)), b_vnd, input_precision=PREC)
    tl.store(p_s, b_s, mask=m_s)


@jit
def kda_output_kernel(q, g2, rq, aqk, h, vn, o, meta, stride_q, stride_o, H: tl.constexpr,
                      K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                      PREC: tl.constexpr, DOT: tl.constexpr):
    """One (chunk, head, value block): o = (q exp(G)) S_chunk + Aqk v', S_chunk the state the
    chunk starts from (q normalised and scaled)."""
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    o_v = i_v * BV + tl.arange(0, BV)
    rows = t0 + o_t
    m_t = rows < t_end
    rows = rows.to(tl.int64)
    b_rq = tl.load(rq + rows * H + i_h, mask=m_t, other=0.0)
    p_h = h + (i_c * H + i_h).to(tl.int64) * (K * V)
    b_o = tl.zeros([64, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        o_k = c0 + tl.arange(0, BK)
        b_g = _load_rows(g2 + i_h * K, t0, t_end, H * K, c0, K, BK, 64)
        b_q = _load_rows(q + i_h * K, t0, t_end, stride_q, c0, K, BK, 64)
        b_q = b_q * b_rq[:, None] * tl.exp2(b_g)
        b_h = tl.load(p_h + o_k[:, None] * V + o_v[None, :],
                      mask=(o_k < K)[:, None] & (o_v < V)[None, :], other=0.0)
        b_o = tl.dot(b_q.to(DOT), b_h.to(DOT), b_o, input_precision=PREC)
    m_a = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_a = tl.load(aqk + rows[:, None] * (H * 64) + i_h * 64 + o_t[None, :], mask=m_a, other=0.0)
    m_tv = m_t[:, None] & (o_v < V)[None, :]
    b_v = tl.load(vn + rows[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
    b_o = tl.dot(b_a.to(DOT), b_v.to(DOT), b_o, input_precision=PREC)
    tl.store(o + rows[:, None] * stride_o + i_h * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_tv)


def staged_buffers(q: torch.Tensor, v: torch.Tensor, num_chunks: int,
                   config: StagedConfig) -> StagedBuffers:
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    dev = q.device

    def per_token(width: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.empty(num_tokens, heads, width, dtype=dtype, device=dev)

    tinv_dt = dt if config.inverse_bf16 else torch.float32
    qg = torch.empty(0, dtype=dt, device=dev) if config.split_output else per_token(dk)
    walk = PrefillBuffers(per_token(dk), per_token(dv), qg, per_token(dk), per_token(CHUNK),
                          torch.empty(num_chunks, heads, dk, dtype=torch.float32, device=dev))
    norms = torch.empty(2, num_tokens, heads, dtype=torch.float32, device=dev)
    return StagedBuffers(per_token(dk, torch.float32), norms[0], norms[1], per_token(CHUNK, tinv_dt),
                         walk)


def _chunk_meta(plan: KdaPlan) -> torch.Tensor:
    return plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]


def launch_gate(q, k, g, buf: StagedBuffers, plan: KdaPlan, config: StagedConfig) -> None:
    heads, dk = q.shape[1], q.shape[2]
    kda_gate_kernel[(plan.num_chunks, heads)](
        q, k, g, buf.g2, buf.rq, buf.rk, _chunk_meta(plan), dk ** -0.5, q.stride(0),
        k.stride(0), g.stride(0), H=heads, K=dk, BK=triton.next_power_of_2(dk),
        num_warps=config.gate_warps)


def launch_intra(q, k, beta, buf: StagedBuffers, plan: KdaPlan, config: StagedConfig) -> None:
    heads, dk = q.shape[1], q.shape[2]
    bk = min(config.intra_key_block, triton.next_power_of_2(dk))
    assert bk >= 16, "head dims below 16 do not fit tl.dot"
    kda_intra_kernel[(plan.num_chunks, heads)](
        q, k, buf.g2, buf.rq, buf.rk, beta, buf.walk.aqk, buf.tinv, _chunk_meta(plan),
        q.stride(0), k.stride(0), beta.stride(0), H=heads, K=dk, BK=bk,
        PREC=product_precision(q.dtype), SOLVE="ieee", num_warps=config.intra_warps)


def launch_wy(q, k, v, beta, buf: StagedBuffers, plan: KdaPlan, config: StagedConfig) -> None:
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    bk = min(config.wy_block, triton.next_power_of_2(dk))
    bv = min(config.wy_block, triton.next_power_of_2(dv))
    wb = buf.walk
    kda_wy_kernel[(plan.num_chunks, heads)](
        q, k, v, buf.g2, buf.rq, buf.rk, beta, buf.tinv, wb.w, wb.u, wb.qg, wb.kd, wb.gl,
        _chunk_meta(plan), q.stride(0), k.stride(0), v.stride(0), beta.stride(0), H=heads,
        K=dk, V=dv, BK=bk, BV=bv, DOT=dot_operand_type(buf.tinv.dtype),
        PREC=product_precision(q.dtype), STORE_QG=not config.split_output,
        num_warps=config.wy_warps)


def split_buffers(q: torch.Tensor, v: torch.Tensor, num_chunks: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The state each chunk starts from `[chunks, H, K, V]` and v' `[T, H, V]`, in the dtype of
    the walk's products."""
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    dt = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.float32
    return (torch.empty(num_chunks, heads, dk, dv, dtype=dt, device=q.device),
            torch.empty(q.shape[0], heads, dv, dtype=dt, device=q.device))


def launch_walk_h(state, buf: StagedBuffers, h, vn, plan: KdaPlan, config: KdaConfig) -> None:
    heads, dk, dv = state.shape[1:]
    bv = min(config.state_value_block, triton.next_power_of_2(dv))
    wb = buf.walk
    kda_walk_h_kernel[(plan.num_prefill, heads, triton.cdiv(dv, bv))](
        wb.w, wb.u, wb.kd, wb.gl, state, h, vn, plan.meta[plan.num_decode * 3:], H=heads, K=dk,
        V=dv, BK=triton.next_power_of_2(dk), BV=bv, PREC=product_precision(h.dtype),
        DOT=dot_operand_type(h.dtype), num_warps=config.state_warps)


def launch_output(q, out, buf: StagedBuffers, h, vn, plan: KdaPlan, config: StagedConfig
                  ) -> None:
    heads, dk, dv = q.shape[1], q.shape[2], out.shape[2]
    bv = min(config.out_value_block, triton.next_power_of_2(dv))
    bk = min(64, triton.next_power_of_2(dk))
    kda_output_kernel[(plan.num_chunks, heads, triton.cdiv(dv, bv))](
        q, buf.g2, buf.rq, buf.walk.aqk, h, vn, out, _chunk_meta(plan), q.stride(0),
        out.stride(0), H=heads, K=dk, V=dv, BK=bk, BV=bv, PREC=product_precision(h.dtype),
        DOT=dot_operand_type(h.dtype), num_warps=config.out_warps)


def prefill(q, k, v, g, beta, state, out, plan: KdaPlan, config: KdaConfig) -> None:
    """Chunked prefill of the plan's sequences longer than one token, stage by stage."""
    staged = config.staged
    buf = staged_buffers(q, v, plan.num_chunks, staged)
    launch_gate(q, k, g, buf, plan, staged)
    launch_intra(q, k, beta, buf, plan, staged)
    launch_wy(q, k, v, beta, buf, plan, staged)
    if not staged.split_output:
        launch_state(state, out, buf.walk, plan, config)
        return
    h, vn = split_buffers(q, v, plan.num_chunks)
    launch_walk_h(state, buf, h, vn, plan, config)
    launch_output(q, out, buf, h, vn, plan, staged)
