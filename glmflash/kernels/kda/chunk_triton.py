"""Triton KDA chunked prefill: a prep kernel per (64-token chunk, head) in fla's decomposition,
then the state walk per (sequence, head, value block). README.md ("Chunked form", "The prep
kernel") derives both; ref.py's `_chunk` is the spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import constexpr, dot_operand_type, jit, product_precision

if TYPE_CHECKING:
    from glmflash.kernels.kda.triton_impl import KdaConfig, KdaPlan

# Tokens per chunk; the prep kernel splits a chunk into four 16-row sub-chunks.
CHUNK = 64
RCP_LN2 = constexpr(1.4426950408889634)
# Largest decay across a sub-chunk (log2 units, per channel) whose diagonal block is factored
# around its middle: both factors then stay within 2^+-64. Steeper channels take the exact
# form. The release gate (g > -5 per token) spans at most 16 * 5 / ln 2 = 115.4.
SAFE_SPAN = constexpr(128.0)


@jit
def _load_rows(ptr, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
               BR: tl.constexpr):
    """Rows [t0, t0 + BR) x columns [col0, col0 + BCOL) of a row-major matrix, zero past
    t_end or NCOL, as fp32."""
    o_t = t0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + o_c[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@jit
def _store_rows(ptr, b_x, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
                BR: tl.constexpr):
    """Stores b_x `[BR, BCOL]` at rows [t0, t0 + BR) x columns [col0, col0 + BCOL), rows past
    t_end and columns past NCOL left alone."""
    o_t = t0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + o_c[None, :]
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m)


@jit
def _row(x, o_r, r):
    """Row r of a register tile, as a vector over its columns."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), 0)


@jit
def _sub_chunk_keys(k, g, r0, t_end, stride_k, stride_g, c0, K: tl.constexpr,
                    BK: tl.constexpr):
    """Keys [r0, r0 + 16) x channels [c0, c0 + BK): k, the decay e from the sub-chunk's start
    through each row and the decay s across it (log2 units, <= 0)."""
    b_k = _load_rows(k, r0, t_end, stride_k, c0, K, BK, 16)
    b_g = _load_rows(g, r0, t_end, stride_g, c0, K, BK, 16) * RCP_LN2
    return b_k, tl.cumsum(b_g, 0), tl.sum(b_g, 0)


@jit
def _steep_diag_block(q, k, g, t0, t_end, stride_q, stride_k, stride_g, J: tl.constexpr,
                      K: tl.constexpr, BK: tl.constexpr):
    """The steep channels' share of the diagonal block of sub-chunk J, transposed (keys x
    rows) and placed at J's columns of a `[16, 64]` tile, with exact decays exp2(e_t - e_s),
    one key at a time: `_key_block` leaves these channels' rows in J out."""
    o_i = tl.arange(0, 16)
    b_xq = tl.zeros([16, 16], dtype=tl.float32)
    b_xk = tl.zeros([16, 16], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_q = _load_rows(q, t0 + J * 16, t_end, stride_q, c0, K, BK, 16)
        b_k, b_e, b_s = _sub_chunk_keys(k, g, t0 + J * 16, t_end, stride_k, stride_g, c0, K,
                                        BK)
        b_steep = -b_s > SAFE_SPAN
        for c in range(16):
            b_ks = _row(b_k, o_i, c)
            b_es = _row(b_e, o_i, c)
            m = (o_i >= c)[:, None] & b_steep[None, :]
            b_d = tl.exp2(tl.where(m, b_e - b_es[None, :], float("-inf"))) * b_ks[None, :]
            b_xq = tl.where(o_i[:, None] == c, b_xq + tl.sum(b_q * b_d, 1)[None, :], b_xq)
            b_xk = tl.where(o_i[:, None] == c, b_xk + tl.sum(b_k * b_d, 1)[None, :], b_xk)
    m_j = (tl.arange(0, 64) // 16 == J)[None, :]
    return (tl.where(m_j, _stack_cols(b_xq, b_xq, b_xq, b_xq), 0.0),
            tl.where(m_j, _stack_cols(b_xk, b_xk, b_xk, b_xk), 0.0))


@jit
def _key_block(b_aq, b_ak, b_q, b_k, b_e, b_between, b_kj, b_ej, b_sj, J: tl.constexpr,
               PREC: tl.constexpr):
    """Adds one channel block's share of (Aqk)^T and (Akk)^T for the 16 keys of sub-chunk J
    against all 64 rows (rows above are zeroed), `[16, 64]` each. b_e: every row's decay from
    its sub-chunk's start; b_between: the decay from sub-chunk J's start to the row's
    sub-chunk's start (zero in J); b_kj, b_ej, b_sj: J's keys, their b_e rows and the decay
    across J. Decays in log2 units."""
    # The anchor, relative to J's start: its middle decay, so that the factors of J's keys and
    # rows stay within 2^(span / 2) and later rows' within 2^(s_J / 2) <= 1; its end for steep
    # channels (every factor <= 1), whose rows in J are then left to `_steep_diag_block`.
    b_safe = -b_sj <= SAFE_SPAN
    b_h = tl.where(b_safe, 0.5 * b_sj, b_sj)
    b_c = b_kj * tl.exp2(b_h[None, :] - b_ej)  # [16, BK]
    o_blk = tl.arange(0, 64) // 16
    m_r = (o_blk > J)[:, None] | ((o_blk == J)[:, None] & b_safe[None, :])
    b_r = tl.exp2(tl.where(m_r, b_between + b_e - b_h[None, :], float("-inf")))  # [64, BK]
    b_aq = tl.dot(b_c, tl.trans(b_q * b_r), b_aq, input_precision=PREC)
    b_ak = tl.dot(b_c, tl.trans(b_k * b_r), b_ak, input_precision=PREC)
    return b_aq, b_ak


@jit
def _store_aqk(aqk, b_at, b_rnk, b_rnq, t0, t_end, stride_a, J: tl.constexpr):
    """Stores Aqk[:, 16J:16J + 16] from its transpose b_at `[16, 64]`, scaled by the keys' and
    queries' inverse norms and causal."""
    o_t = tl.arange(0, 64)
    o_c = J * 16 + tl.arange(0, 16)
    b_x = b_at * b_rnk[:, None] * b_rnq[None, :]
    b_x = tl.where(o_t[None, :] >= o_c[:, None], b_x, 0.0)
    _store_rows(aqk, tl.trans(b_x), t0, t_end, stride_a, J * 16, 64, 16, 64)


@jit
def _upper_strip(b_akt, b_rnk, b_row, J: tl.constexpr):
    """Rows 16J..16J + 15 of U = (diag(beta) Akk)^T (normalised keys), strictly upper."""
    o_t = tl.arange(0, 64)
    o_c = J * 16 + tl.arange(0, 16)
    b_x = b_akt * b_rnk[:, None] * b_row[None, :]
    return tl.where(o_t[None, :] > o_c[:, None], b_x, 0.0)


@jit
def _unstack_cols(x):
    """`[M, 64]` -> its four `[M, 16]` column blocks."""
    M: tl.constexpr = x.shape[0]
    b_x = tl.permute(tl.reshape(x, (M, 2, 2, 16)), (0, 3, 1, 2))  # block 2a + b at [m, c, a, b]
    b_even, b_odd = tl.split(b_x)
    x0, x2 = tl.split(b_even)
    x1, x3 = tl.split(b_odd)
    return x0, x1, x2, x3


@jit
def _stack_cols(x0, x1, x2, x3):
    """Four `[M, 16]` blocks side by side: `[M, 64]`."""
    b_x = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # x_{2a + b} at [m, c, a, b]
    return tl.reshape(tl.permute(b_x, (0, 2, 3, 1)), (x0.shape[0], 64))


@jit
def _stack_rows(x0, x1, x2, x3):
    """Four `[16, N]` blocks on top of each other: `[64, N]`."""
    b_x = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # x_{2a + b} at [r, n, a, b]
    return tl.reshape(tl.permute(b_x, (2, 3, 0, 1)), (64, x0.shape[1]))


@jit
def _merge_level(b_t, b_u, o_r, o_c, SIZE: tl.constexpr, SOLVE: tl.constexpr):
    """From the inverses of the diagonal blocks of size SIZE / 2 (b_t, zero elsewhere) to those
    of size SIZE: P - P C P, with C the part of b_u in each block's upper-right quarter."""
    HALF: tl.constexpr = SIZE // 2
    m = (o_r // SIZE == o_c // SIZE) & (o_r % SIZE < HALF) & (o_c % SIZE >= HALF)
    b_x = tl.dot(b_t, tl.where(m, b_u, 0.0), input_precision=SOLVE)
    return b_t - tl.dot(b_x, b_t, input_precision=SOLVE)


@jit
def _unit_upper_inverse(b_u, SOLVE: tl.constexpr):
    """(I + U)^-1 of a strictly upper-triangular 16x16 U by recursive block inversion: the
    2x2 diagonal blocks invert to I - U, then three merges of two blocks each."""
    o_i = tl.arange(0, 16)
    o_r, o_c = o_i[:, None], o_i[None, :]
    b_t = tl.where(o_r == o_c, 1.0, 0.0) - tl.where(o_r // 2 == o_c // 2, b_u, 0.0)
    b_t = _merge_level(b_t, b_u, o_r, o_c, 4, SOLVE)
    b_t = _merge_level(b_t, b_u, o_r, o_c, 8, SOLVE)
    return _merge_level(b_t, b_u, o_r, o_c, 16, SOLVE)


@jit
def _upper_inverse(b_u0, b_u1, b_u2, b_u3, SOLVE: tl.constexpr):
    """V = (I + U)^-1 `[64, 64]` for strictly upper-triangular U given as four row strips
    `[16, 64]` (`_upper_inverse_blocks`, stacked)."""
    b_u00, b_u01, b_u02, b_u03 = _unstack_cols(b_u0)
    _, b_u11, b_u12, b_u13 = _unstack_cols(b_u1)
    _, _, b_u22, b_u23 = _unstack_cols(b_u2)
    _, _, _, b_u33 = _unstack_cols(b_u3)
    b_v00, b_v01, b_v02, b_v03, b_v11, b_v12, b_v13, b_v22, b_v23, b_v33 = \
        _upper_inverse_blocks(b_u00, b_u01, b_u02, b_u03, b_u11, b_u12, b_u13, b_u22, b_u23,
                              b_u33, SOLVE)
    b_z = tl.zeros([16, 16], dtype=tl.float32)
    return _stack_rows(_stack_cols(b_v00, b_v01, b_v02, b_v03),
                       _stack_cols(b_z, b_v11, b_v12, b_v13),
                       _stack_cols(b_z, b_z, b_v22, b_v23),
                       _stack_cols(b_z, b_z, b_z, b_v33))


@jit
def _upper_inverse_blocks(b_u00, b_u01, b_u02, b_u03, b_u11, b_u12, b_u13, b_u22, b_u23, b_u33,
                          SOLVE: tl.constexpr):
    """The 16x16 blocks V_ji (j <= i) of V = (I + U)^-1 for strictly upper-triangular U given
    by its blocks U_ji: the diagonal blocks' inverses, then block back substitution along the
    rows, V_ji = -(sum_{j <= m < i} V_jm U_mi) V_ii."""
    b_v00 = _unit_upper_inverse(b_u00, SOLVE)
    b_v11 = _unit_upper_inverse(b_u11, SOLVE)
    b_v22 = _unit_upper_inverse(b_u22, SOLVE)
    b_v33 = _unit_upper_inverse(b_u33, SOLVE)
    b_x = tl.dot(b_v00, b_u01, input_precision=SOLVE)
    b_v01 = -tl.dot(b_x, b_v11, input_precision=SOLVE)
    b_x = tl.dot(b_v11, b_u12, input_precision=SOLVE)
    b_v12 = -tl.dot(b_x, b_v22, input_precision=SOLVE)
    b_x = tl.dot(b_v22, b_u23, input_precision=SOLVE)
    b_v23 = -tl.dot(b_x, b_v33, input_precision=SOLVE)
    b_x = tl.dot(b_v00, b_u02, input_precision=SOLVE)
    b_x = tl.dot(b_v01, b_u12, b_x, input_precision=SOLVE)
    b_v02 = -tl.dot(b_x, b_v22, input_precision=SOLVE)
    b_x = tl.dot(b_v11, b_u13, input_precision=SOLVE)
    b_x = tl.dot(b_v12, b_u23, b_x, input_precision=SOLVE)
    b_v13 = -tl.dot(b_x, b_v33, input_precision=SOLVE)
    b_x = tl.dot(b_v00, b_u03, input_precision=SOLVE)
    b_x = tl.dot(b_v01, b_u13, b_x, input_precision=SOLVE)
    b_x = tl.dot(b_v02, b_u23, b_x, input_precision=SOLVE)
    b_v03 = -tl.dot(b_x, b_v33, input_precision=SOLVE)
    return b_v00, b_v01, b_v02, b_v03, b_v11, b_v12, b_v13, b_v22, b_v23, b_v33


@jit
def kda_chunk_prep_kernel(q, k, v, g, beta, w, u, qg, kd, aqk, gl, meta, scale,
                          stride_q, stride_k, stride_v, stride_g, stride_b,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                          SOLVE: tl.constexpr):
    """One (chunk, head): Aqk (scaled, causal), T = (I + diag(beta) Akk)^-1, w = T (beta k
    exp(G)), u = T (beta v), qg = q exp(G), kd = k exp(G_last - G) and exp(G_last), with q and
    k l2-normalised and G the decay from the chunk start. The A products run per sub-chunk of
    16 keys against all 64 rows, transposed (M = 16); the inverse works on 16x16 blocks.
    PREC: the A, w and u products; SOLVE: the inverse's."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    q += i_h * K
    k += i_h * K
    g += i_h * K
    b_aq0 = tl.zeros([16, 64], dtype=tl.float32)
    b_aq1, b_aq2, b_aq3 = b_aq0, b_aq0, b_aq0
    b_ak0, b_ak1, b_ak2, b_ak3 = b_aq0, b_aq0, b_aq0, b_aq0
    b_nq = tl.zeros([64], dtype=tl.float32)
    b_nk = b_nq
    b_nc0 = tl.zeros([16], dtype=tl.float32)
    b_nc1, b_nc2, b_nc3 = b_nc0, b_nc0, b_nc0
    b_span = 0.0
    o_blk = tl.arange(0, 64) // 16
    # NOTE: real loops, not unrolled: the bodies are large and the instruction cache small.
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_q = _load_rows(q, t0, t_end, stride_q, c0, K, BK, 64)  # [64, BK]
        b_k = _load_rows(k, t0, t_end, stride_k, c0, K, BK, 64)
        b_nq += tl.sum(b_q * b_q, 1)
        b_nk += tl.sum(b_k * b_k, 1)
        b_k0, b_e0, b_s0 = _sub_chunk_keys(k, g, t0, t_end, stride_k, stride_g, c0, K, BK)
        b_k1, b_e1, b_s1 = _sub_chunk_keys(k, g, t0 + 16, t_end, stride_k, stride_g, c0, K, BK)
        b_k2, b_e2, b_s2 = _sub_chunk_keys(k, g, t0 + 32, t_end, stride_k, stride_g, c0, K, BK)
        b_k3, b_e3, b_s3 = _sub_chunk_keys(k, g, t0 + 48, t_end, stride_k, stride_g, c0, K, BK)
        b_nc0 += tl.sum(b_k0 * b_k0, 1)
        b_nc1 += tl.sum(b_k1 * b_k1, 1)
        b_nc2 += tl.sum(b_k2 * b_k2, 1)
        b_nc3 += tl.sum(b_k3 * b_k3, 1)
        b_s = tl.minimum(tl.minimum(b_s0, b_s1), tl.minimum(b_s2, b_s3))
        b_span = tl.maximum(b_span, -tl.min(b_s, 0))  # the steepest sub-chunk so far
        # NOTE: both sides of a product take their decays from the same b_e values, so that
        # a diagonal entry's factors cancel exactly, as the reference's difference does.
        b_e = _stack_rows(b_e0, b_e1, b_e2, b_e3)  # [64, BK]
        # From sub-chunk J's start to each later row's sub-chunk's start, J = 3, 2, 1, 0.
        b_aq3, b_ak3 = _key_block(b_aq3, b_ak3, b_q, b_k, b_e, 0.0, b_k3, b_e3, b_s3, 3, PREC)
        b_between = tl.where(o_blk[:, None] >= 3, b_s2[None, :], 0.0)
        b_aq2, b_ak2 = _key_block(b_aq2, b_ak2, b_q, b_k, b_e, b_between, b_k2, b_e2, b_s2, 2,
                                  PREC)
        b_between += tl.where(o_blk[:, None] >= 2, b_s1[None, :], 0.0)
        b_aq1, b_ak1 = _key_block(b_aq1, b_ak1, b_q, b_k, b_e, b_between, b_k1, b_e1, b_s1, 1,
                                  PREC)
        b_between += tl.where(o_blk[:, None] >= 1, b_s0[None, :], 0.0)
        b_aq0, b_ak0 = _key_block(b_aq0, b_ak0, b_q, b_k, b_e, b_between, b_k0, b_e0, b_s0, 0,
                                  PREC)
    if b_span > SAFE_SPAN:
        b_xq, b_xk = _steep_diag_block(q, k, g, t0, t_end, stride_q, stride_k, stride_g, 0, K, BK)
        b_aq0, b_ak0 = b_aq0 + b_xq, b_ak0 + b_xk
        b_xq, b_xk = _steep_diag_block(q, k, g, t0, t_end, stride_q, stride_k, stride_g, 1, K, BK)
        b_aq1, b_ak1 = b_aq1 + b_xq, b_ak1 + b_xk
        b_xq, b_xk = _steep_diag_block(q, k, g, t0, t_end, stride_q, stride_k, stride_g, 2, K, BK)
        b_aq2, b_ak2 = b_aq2 + b_xq, b_ak2 + b_xk
        b_xq, b_xk = _steep_diag_block(q, k, g, t0, t_end, stride_q, stride_k, stride_g, 3, K, BK)
        b_aq3, b_ak3 = b_aq3 + b_xq, b_ak3 + b_xk
    # l2 norms as row and column scalings (eps inside the root, as the reference).
    b_rnq = scale / tl.sqrt(b_nq + 1e-6)
    b_rnk = 1.0 / tl.sqrt(b_nk + 1e-6)
    b_rc0 = 1.0 / tl.sqrt(b_nc0 + 1e-6)
    b_rc1 = 1.0 / tl.sqrt(b_nc1 + 1e-6)
    b_rc2 = 1.0 / tl.sqrt(b_nc2 + 1e-6)
    b_rc3 = 1.0 / tl.sqrt(b_nc3 + 1e-6)
    p_a = aqk + i_h * 64
    _store_aqk(p_a, b_aq0, b_rc0, b_rnq, t0, t_end, H * 64, 0)
    _store_aqk(p_a, b_aq1, b_rc1, b_rnq, t0, t_end, H * 64, 1)
    _store_aqk(p_a, b_aq2, b_rc2, b_rnq, t0, t_end, H * 64, 2)
    _store_aqk(p_a, b_aq3, b_rc3, b_rnq, t0, t_end, H * 64, 3)
    o_t = t0 + tl.arange(0, 64)
    b_b = tl.load(beta + o_t.to(tl.int64) * stride_b + i_h, mask=o_t < t_end,
                  other=0.0).to(tl.float32)
    # V = T^T = (I + U)^-1 with U = (diag(beta) Akk)^T.
    b_row = b_b * b_rnk
    b_vt = _upper_inverse(_upper_strip(b_ak0, b_rc0, b_row, 0),
                          _upper_strip(b_ak1, b_rc1, b_row, 1),
                          _upper_strip(b_ak2, b_rc2, b_row, 2),
                          _upper_strip(b_ak3, b_rc3, b_row, 3), SOLVE)  # [64, 64]
    # w, qg, kd and exp(G_last) per channel block, from q, k and g loaded again (the first
    # pass needed the norms first); w^T = (beta k exp(G))^T V.
    w += i_h * K
    qg += i_h * K
    kd += i_h * K
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_g = _load_rows(g, t0, t_end, stride_g, c0, K, BK, 64) * RCP_LN2
        b_G = tl.cumsum(b_g, 0)
        b_last = tl.sum(b_g, 0)
        o_k = c0 + tl.arange(0, BK)
        tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp2(b_last), mask=o_k < K)
        b_d = tl.exp2(b_G)  # [64, BK]
        b_q = _load_rows(q, t0, t_end, stride_q, c0, K, BK, 64) * b_rnq[:, None]
        _store_rows(qg, b_q * b_d, t0, t_end, H * K, c0, K, BK, 64)
        b_k = _load_rows(k, t0, t_end, stride_k, c0, K, BK, 64) * b_rnk[:, None]
        _store_rows(kd, b_k * tl.exp2(b_last[None, :] - b_G), t0, t_end, H * K, c0, K, BK, 64)
        b_xt = tl.trans(b_k * b_d * b_b[:, None])  # [BK, 64]
        b_w = tl.trans(tl.dot(b_xt, b_vt, input_precision=PREC))
        _store_rows(w, b_w, t0, t_end, H * K, c0, K, BK, 64)
    v += i_h * V
    u += i_h * V
    for i_v in range(tl.cdiv(V, BV)):
        c0 = i_v * BV
        b_xt = tl.trans(_load_rows(v, t0, t_end, stride_v, c0, V, BV, 64) * b_b[:, None])
        b_u = tl.trans(tl.dot(b_xt, b_vt, input_precision=PREC))  # [64, BV]
        _store_rows(u, b_u, t0, t_end, H * V, c0, V, BV, 64)


@jit
def _walk_start(state, meta, i_n, i_h, o_k, o_v, m_s, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr):
    """Where the state walk of prefill sequence i_n starts: its token range and first chunk
    (`meta` rows of start, end, slot, fresh, chunk0), and head i_h's state block in its slot,
    as pointers and as values (zeros for a fresh sequence)."""
    start = tl.load(meta + i_n * 5)
    end = tl.load(meta + i_n * 5 + 1)
    slot = tl.load(meta + i_n * 5 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 5 + 3)
    chunk0 = tl.load(meta + i_n * 5 + 4)
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    # NOTE: scalar masks are broadcast by hand (the interpreter rejects scalar & tensor).
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32
    return start, end, chunk0, p_s, b_s


@jit
def kda_chunk_state_kernel(w, u, qg, kd, aqk, gl, state, o, meta, stride_o,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                           DOT: tl.constexpr):
    """Walk one sequence's chunks for one (head, value block): v' = u - w S, output
    o = qg S + Aqk v', then S <- exp(G_last) S + kd^T v'. Initial and final S in the slot."""
    BT: tl.constexpr = 64
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    start, end, chunk0, p_s, b_s = _walk_start(state, meta, i_n, i_h, o_k, o_v, m_s, H, K, V)
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
        b_sd = b_s.to(DOT)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(DOT), b_sd, input_precision=PREC)  # [BT, BV]
        b_vnd = b_vn.to(DOT)
        b_o = tl.dot(b_qg.to(DOT), b_sd, input_precision=PREC)
        b_o = tl.dot(b_a.to(DOT), b_vnd, b_o, input_precision=PREC)
        tl.store(o + rows[:, None] * stride_o + i_h * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_gl[:, None] + tl.dot(tl.trans(b_kd.to(DOT)), b_vnd, input_precision=PREC)
    tl.store(p_s, b_s, mask=m_s)


class PrefillBuffers(NamedTuple):
    """What the prep kernel hands the state walk: per token and head w, u, qg, kd and a row of
    Aqk, per chunk and head exp(G_last)."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    aqk: torch.Tensor
    gl: torch.Tensor


def prefill_buffers(q: torch.Tensor, v: torch.Tensor, num_chunks: int) -> PrefillBuffers:
    num_tokens, heads, dk = q.shape
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32

    def per_token(width: int) -> torch.Tensor:
        return torch.empty(num_tokens, heads, width, dtype=dt, device=q.device)

    gl = torch.empty(num_chunks, heads, dk, dtype=torch.float32, device=q.device)
    return PrefillBuffers(per_token(dk), per_token(v.shape[2]), per_token(dk), per_token(dk),
                          per_token(CHUNK), gl)


def launch_prep(q, k, v, g, beta, buf: PrefillBuffers, plan: KdaPlan, config: KdaConfig) -> None:
    """The prep kernel over every chunk of the plan's prefill sequences."""
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    bk = min(config.prep_key_block, triton.next_power_of_2(dk))
    bv = min(config.prep_value_block, triton.next_power_of_2(dv))
    assert bk >= 16 and bv >= 16, "head dims below 16 do not fit tl.dot"
    chunk_meta = plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]
    kda_chunk_prep_kernel[(plan.num_chunks, heads)](
        q, k, v, g, beta, *buf, chunk_meta, dk ** -0.5, q.stride(0), k.stride(0), v.stride(0),
        g.stride(0), beta.stride(0), H=heads, K=dk, V=dv, BK=bk, BV=bv,
        PREC=product_precision(q.dtype), SOLVE="ieee", num_warps=config.prep_warps)


def launch_state(state, out, buf: PrefillBuffers, plan: KdaPlan, config: KdaConfig) -> None:
    """The state walk over the plan's prefill sequences, from the prep kernel's buffers."""
    heads, dk, dv = state.shape[1:]
    bk = triton.next_power_of_2(dk)
    bv = min(config.state_value_block, triton.next_power_of_2(dv))
    seq_meta = plan.meta[plan.num_decode * 3:]
    kda_chunk_state_kernel[(plan.num_prefill, heads, triton.cdiv(dv, bv))](
        buf.w, buf.u, buf.qg, buf.kd, buf.aqk, buf.gl, state, out, seq_meta, out.stride(0),
        H=heads, K=dk, V=dv, BK=bk, BV=bv, PREC=product_precision(out.dtype),
        DOT=dot_operand_type(out.dtype), num_warps=config.state_warps)


def prefill(q, k, v, g, beta, state, out, plan: KdaPlan, config: KdaConfig) -> None:
    """Chunked prefill of the plan's sequences longer than one token: prep, then state walk."""
    buf = prefill_buffers(q, v, plan.num_chunks)
    launch_prep(q, k, v, g, beta, buf, plan, config)
    launch_state(state, out, buf, plan, config)
