"""The gate and intra-chunk stages of the KDA prefill (chunk_stages.py; README.md, "The
stages"): the decay's cumulative sum and the norms, then Aqk and T = (I + diag(beta) Akk)^-1 of
each 64-token chunk from 16x16 blocks, in two kernels as fla-core splits the intra stage: the
gate stage and the diagonal blocks in a program per (chunk, 16-row sub-chunk, head), then the
blocks below them and the merge of the inverse in a program per (chunk, head) that reads each
sub-chunk once per channel block. Each holds little, so both run with few warps and many
programs per SM.
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    tl = None

from glmflash.kernels.kda.chunk_walk import _chunk_ids, _load_rows, _store_rows
from glmflash.kernels.triton_utils import constexpr, jit

RCP_LN2 = constexpr(1.4426950408889634)  # g is in natural-log units; G is kept in log2 units
# Largest decay across a sub-chunk (log2 units, per channel) whose diagonal block is factored
# around its middle: both factors then stay within 2^+-64. Steeper channels take the exact
# form. The release gate (g > -5 per token) spans at most 16 * 5 / ln 2 = 115.4.
SAFE_SPAN = constexpr(128.0)


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
def _rows(q, k, g2, r0, t_end, stride_q, stride_k, c0, H: tl.constexpr, K: tl.constexpr,
          BK: tl.constexpr):
    """q, k and the cumulative decay G `[16, BK]` of the rows r0.., and G's first and last row
    (the decay across the sub-chunk is first - last)."""
    b_q = _load_rows(q, r0, t_end, stride_q, c0, K, BK, 16)
    b_k = _load_rows(k, r0, t_end, stride_k, c0, K, BK, 16)
    b_g = _load_rows(g2, r0, t_end, H * K, c0, K, BK, 16)
    return (b_q, b_k, b_g, _g_row(g2, r0, t_end, c0, H, K, BK),
            _g_row(g2, r0 + 15, t_end, c0, H, K, BK))


@jit
def _diag_products(b_aq, b_akk, b_q, b_k, b_g, b_first, b_last, m_r, PREC: tl.constexpr):
    """Adds one channel block's share of a sub-chunk's diagonal blocks of Aqk and Akk. Each
    channel is anchored at its middle decay across the sub-chunk, so both factors stay within
    2^(span / 2); channels steeper than SAFE_SPAN are left to `_steep_diag`."""
    b_mid = 0.5 * (b_first + b_last)
    m = m_r[:, None] & (b_first - b_last <= SAFE_SPAN)[None, :]
    b_up = tl.where(m, tl.exp2(b_g - b_mid[None, :]), 0.0)
    b_kt = tl.trans(b_k * tl.where(m, tl.exp2(b_mid[None, :] - b_g), 0.0))
    b_aq = tl.dot(b_q * b_up, b_kt, b_aq, input_precision=PREC)
    b_akk = tl.dot(b_k * b_up, b_kt, b_akk, input_precision=PREC)
    return b_aq, b_akk


@jit
def _row_factors(b_q, b_k, b_g, b_first, r0, t_end):
    """A sub-chunk's q and k times exp2(G - G_first) (<= 1), zero past t_end."""
    m_r = r0 + tl.arange(0, 16) < t_end
    b_x = tl.where(m_r[:, None], tl.exp2(b_g - b_first[None, :]), 0.0)
    return b_q * b_x, b_k * b_x


@jit
def _steep_diag(b_aq, b_akk, b_span, q, k, g2, r0, t_end, stride_q, stride_k,
                H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """Adds the steep channels' (span > SAFE_SPAN) share of a sub-chunk's diagonal blocks with
    exact decays exp2(G_t - G_s), one key at a time, when b_span says there are any."""
    if b_span > SAFE_SPAN:
        o_i = tl.arange(0, 16)
        m_r = r0 + o_i < t_end
        for i_k in range(tl.cdiv(K, BK)):
            c0 = i_k * BK
            o_k = c0 + tl.arange(0, BK)
            b_q, b_k, b_g, b_first, b_last = _rows(q, k, g2, r0, t_end, stride_q, stride_k, c0,
                                                   H, K, BK)
            b_steep = b_first - b_last > SAFE_SPAN
            for c in range(16):
                m_c = (o_k < K) & (o_k * 0 + r0 + c < t_end)
                b_kc = tl.load(k + (r0 + c).to(tl.int64) * stride_k + o_k, mask=m_c, other=0.0)
                b_gc = tl.load(g2 + (r0 + c).to(tl.int64) * (H * K) + o_k, mask=m_c, other=0.0)
                m = (m_r & (o_i >= c))[:, None] & b_steep[None, :]
                b_d = tl.exp2(tl.where(m, b_g - b_gc[None, :], float("-inf")))
                b_d = b_d * b_kc.to(tl.float32)[None, :]
                m_col = o_i[None, :] == c
                b_aq = tl.where(m_col, b_aq + tl.sum(b_q * b_d, 1)[:, None], b_aq)
                b_akk = tl.where(m_col, b_akk + tl.sum(b_k * b_d, 1)[:, None], b_akk)
    return b_aq, b_akk


@jit
def _store_block(ptr, b_x, r0, col0, t_end, stride):
    """Stores a 16x16 block at rows r0.., columns col0.., rows past t_end left alone."""
    o_a = tl.arange(0, 16)
    rows = r0 + o_a[:, None]
    tl.store(ptr + rows.to(tl.int64) * stride + col0 + o_a[None, :],
             b_x.to(ptr.dtype.element_ty), mask=rows < t_end)


@jit
def _store_aqk(aqk, b_a, b_rq, b_rk, r0, col0, t_end, H: tl.constexpr, DIAG: tl.constexpr):
    """A block of Aqk, normalised (and scaled: b_rq holds the scale), causal on the diagonal."""
    b_a = b_a * b_rq[:, None] * b_rk[None, :]
    if DIAG:
        o_i = tl.arange(0, 16)
        b_a = tl.where(o_i[:, None] >= o_i[None, :], b_a, 0.0)
    _store_block(aqk, b_a, r0, col0, t_end, H * 64)


@jit
def _l_block(b_akk, b_row, b_rk, DIAG: tl.constexpr):
    """A block of L = diag(beta) Akk (normalised keys; b_row = beta / |k| of the rows),
    strictly lower on the diagonal."""
    b_l = b_akk * b_row[:, None] * b_rk[None, :]
    if DIAG:
        o_i = tl.arange(0, 16)
        b_l = tl.where(o_i[:, None] > o_i[None, :], b_l, 0.0)
    return b_l


@jit
def _diag_inverse(b_akk, b_row, b_rk, SOLVE: tl.constexpr):
    """(I + L_ii)^-1 of a diagonal block, through the upper-triangular recursive inverse."""
    b_u = tl.trans(_l_block(b_akk, b_row, b_rk, True))
    return tl.trans(_unit_upper_inverse(b_u, SOLVE))


@jit
def _gated_rows(g, g2, t0, r0, t_end, stride_g, c0, H: tl.constexpr, K: tl.constexpr,
                BK: tl.constexpr):
    """G of rows r0.. (channels c0..) from the chunk start, in log2 units, stored to g2: the
    earlier sub-chunks' decay summed here, plus this one's cumulative sum. Rows past t_end add
    nothing, so they repeat the last row's G (as _g_row's clamp does)."""
    b_start = tl.zeros([BK], dtype=tl.float32)
    for r in range(t0, r0, 16):
        b_start += tl.sum(_load_rows(g, r, t_end, stride_g, c0, K, BK, 16), 0) * RCP_LN2
    b_g = b_start[None, :] + tl.cumsum(_load_rows(g, r0, t_end, stride_g, c0, K, BK, 16)
                                       * RCP_LN2, 0)
    _store_rows(g2, b_g, r0, t_end, H * K, c0, K, BK, 16)
    return b_g


@jit
def _store_inverse_norms(rq, rk, b_nq, b_nk, scale, r0, t_end, i_h, H: tl.constexpr,
                        BR: tl.constexpr):
    """scale / |q| and 1 / |k| of rows r0.. of head i_h from their squared norms (eps inside
    the root, as the reference), stored at `[row, i_h]` and returned, zero past t_end."""
    o_t = r0 + tl.arange(0, BR)
    m_t = o_t < t_end
    b_rq = tl.where(m_t, scale / tl.sqrt(b_nq + 1e-6), 0.0)
    b_rk = tl.where(m_t, 1.0 / tl.sqrt(b_nk + 1e-6), 0.0)
    p = o_t.to(tl.int64) * H + i_h
    tl.store(rq + p, b_rq, mask=m_t)
    tl.store(rk + p, b_rk, mask=m_t)
    return b_rq, b_rk


@jit
def _row(x, r):
    """Row r of a `[16, N]` register tile, as a vector over its columns."""
    return tl.sum(tl.where(tl.arange(0, 16)[:, None] == r, x, 0.0), 0)


@jit
def kda_intra_diag_kernel(q, k, g, g2, rq, rk, beta, aqk, tinv, tdiag, meta, scale, stride_q,
                          stride_k, stride_g, stride_b, H: tl.constexpr, K: tl.constexpr,
                          BK: tl.constexpr, PREC: tl.constexpr, SOLVE: tl.constexpr):
    """One (chunk, 16-row sub-chunk, head): the gate stage for its own rows (G from g, the
    earlier sub-chunks' rows summed here, stored to g2; scale / |q| and 1 / |k|, eps inside
    the root as the reference), then the sub-chunk's diagonal block of Aqk (scaled, normalised,
    causal) and T_ii = (I + L_ii)^-1, stored in tinv and, fp32, in tdiag `[T, H, 16]` for
    `kda_intra_off_kernel`."""
    i_c, i_s, i_h = _chunk_ids(H, 4)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    r0 = t0 + i_s * 16
    if r0 >= t_end:
        return
    q += i_h * K
    k += i_h * K
    g += i_h * K
    g2 += i_h * K
    o_r = tl.arange(0, 16)
    m_r = r0 + o_r < t_end
    b_a = tl.zeros([16, 16], dtype=tl.float32)
    b_akk = b_a
    b_nq = tl.zeros([16], dtype=tl.float32)
    b_nk = b_nq
    b_span = 0.0
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_g = _gated_rows(g, g2, t0, r0, t_end, stride_g, c0, H, K, BK)
        b_q = _load_rows(q, r0, t_end, stride_q, c0, K, BK, 16)
        b_k = _load_rows(k, r0, t_end, stride_k, c0, K, BK, 16)
        b_nq += tl.sum(b_q * b_q, 1)
        b_nk += tl.sum(b_k * b_k, 1)
        b_f, b_l = _row(b_g, 0), _row(b_g, 15)
        b_a, b_akk = _diag_products(b_a, b_akk, b_q, b_k, b_g, b_f, b_l, m_r, PREC)
        b_span = tl.maximum(b_span, tl.max(b_f - b_l, 0))
    # NOTE: the steep form reads back the G this program's threads stored.
    tl.debug_barrier()
    b_a, b_akk = _steep_diag(b_a, b_akk, b_span, q, k, g2, r0, t_end, stride_q, stride_k, H, K,
                             BK)
    b_rq, b_rk = _store_inverse_norms(rq, rk, b_nq, b_nk, scale, r0, t_end, i_h, H, 16)
    _store_aqk(aqk + i_h * 64, b_a, b_rq, b_rk, r0, i_s * 16, t_end, H, True)
    b_row = _row_vec(beta + i_h, r0, t_end, stride_b) * b_rk
    b_t = _diag_inverse(b_akk, b_row, b_rk, SOLVE)
    _store_block(tinv + i_h * 64, b_t, r0, i_s * 16, t_end, H * 64)
    _store_block(tdiag + i_h * 16, b_t, r0, 0, t_end, H * 16)


@jit
def _anchored_rows(q, k, g2, r0, t_end, stride_q, stride_k, c0, H: tl.constexpr,
                   K: tl.constexpr, BK: tl.constexpr):
    """A sub-chunk as the rows of off-diagonal blocks: q and k times exp2(G - G_first) (<= 1,
    zero past t_end), G_first, and its k and G for when it is the keys of later rows."""
    b_q, b_k, b_g, b_f, _ = _rows(q, k, g2, r0, t_end, stride_q, stride_k, c0, H, K, BK)
    b_qa, b_ka = _row_factors(b_q, b_k, b_g, b_f, r0, t_end)
    return b_qa, b_ka, b_f, b_k, b_g


@jit
def _pair_products(b_aq, b_akk, b_qa, b_ka, b_f, b_kj, b_gj, r0j, t_end, PREC: tl.constexpr):
    """Adds one channel block's share of the block (rows i, keys of sub-chunk j < i) of Aqk and
    Akk: the keys carry exp2(G_first(i) - G) <= 1."""
    m_r = r0j + tl.arange(0, 16) < t_end
    b_kt = tl.trans(b_kj * tl.where(m_r[:, None], tl.exp2(b_f[None, :] - b_gj), 0.0))
    b_aq = tl.dot(b_qa, b_kt, b_aq, input_precision=PREC)
    b_akk = tl.dot(b_ka, b_kt, b_akk, input_precision=PREC)
    return b_aq, b_akk


@jit
def _load_t(tdiag, r0, t_end, H: tl.constexpr):
    """A diagonal block of T from `kda_intra_diag_kernel`'s fp32 copy, zero past t_end."""
    return _load_rows(tdiag, r0, t_end, H * 16, 0, 16, 16, 16)


@jit
def kda_intra_off_kernel(q, k, g2, rq, rk, beta, aqk, tinv, tdiag, meta, stride_q, stride_k,
                         stride_b, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                         PREC: tl.constexpr, SOLVE: tl.constexpr):
    """One (chunk, head): the six blocks below the diagonal of Aqk and Akk (rows anchored at
    their sub-chunk's first decay, so every factor is <= 1), then T's blocks below the
    diagonal from the diagonal ones, T_ij = -T_ii sum_{j <= m < i} L_im T_mj."""
    i_c, _sub, i_h = _chunk_ids(H, 1)  # one program per (chunk, head)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    if t_end - t0 <= 16:
        return
    q += i_h * K
    k += i_h * K
    g2 += i_h * K
    r1, r2, r3 = t0 + 16, t0 + 32, t0 + 48
    z = tl.zeros([16, 16], dtype=tl.float32)
    a10, k10, a20, k20, a21, k21 = z, z, z, z, z, z
    a30, k30, a31, k31, a32, k32 = z, z, z, z, z, z
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_k0 = _load_rows(k, t0, t_end, stride_k, c0, K, BK, 16)
        b_g0 = _load_rows(g2, t0, t_end, H * K, c0, K, BK, 16)
        b_qa, b_ka, b_f, b_k1, b_g1 = _anchored_rows(q, k, g2, r1, t_end, stride_q, stride_k,
                                                     c0, H, K, BK)
        a10, k10 = _pair_products(a10, k10, b_qa, b_ka, b_f, b_k0, b_g0, t0, t_end, PREC)
        b_qa, b_ka, b_f, b_k2, b_g2 = _anchored_rows(q, k, g2, r2, t_end, stride_q, stride_k,
                                                     c0, H, K, BK)
        a20, k20 = _pair_products(a20, k20, b_qa, b_ka, b_f, b_k0, b_g0, t0, t_end, PREC)
        a21, k21 = _pair_products(a21, k21, b_qa, b_ka, b_f, b_k1, b_g1, r1, t_end, PREC)
        b_qa, b_ka, b_f, _, _ = _anchored_rows(q, k, g2, r3, t_end, stride_q, stride_k, c0, H,
                                               K, BK)
        a30, k30 = _pair_products(a30, k30, b_qa, b_ka, b_f, b_k0, b_g0, t0, t_end, PREC)
        a31, k31 = _pair_products(a31, k31, b_qa, b_ka, b_f, b_k1, b_g1, r1, t_end, PREC)
        a32, k32 = _pair_products(a32, k32, b_qa, b_ka, b_f, b_k2, b_g2, r2, t_end, PREC)
    rq += i_h
    rk += i_h
    beta += i_h
    aqk += i_h * 64
    tinv += i_h * 64
    tdiag += i_h * 16
    b_rk0, b_rk1 = _row_vec(rk, t0, t_end, H), _row_vec(rk, r1, t_end, H)
    b_rk2, b_rk3 = _row_vec(rk, r2, t_end, H), _row_vec(rk, r3, t_end, H)
    t00, t11 = _load_t(tdiag, t0, t_end, H), _load_t(tdiag, r1, t_end, H)
    t22, t33 = _load_t(tdiag, r2, t_end, H), _load_t(tdiag, r3, t_end, H)

    b_rq = _row_vec(rq, r1, t_end, H)
    _store_aqk(aqk, a10, b_rq, b_rk0, r1, 0, t_end, H, False)
    b_row = _row_vec(beta, r1, t_end, stride_b) * b_rk1
    l10 = _l_block(k10, b_row, b_rk0, False)
    t10 = -tl.dot(t11, tl.dot(l10, t00, input_precision=SOLVE), input_precision=SOLVE)
    _store_block(tinv, t10, r1, 0, t_end, H * 64)

    b_rq = _row_vec(rq, r2, t_end, H)
    _store_aqk(aqk, a20, b_rq, b_rk0, r2, 0, t_end, H, False)
    _store_aqk(aqk, a21, b_rq, b_rk1, r2, 16, t_end, H, False)
    b_row = _row_vec(beta, r2, t_end, stride_b) * b_rk2
    l20 = _l_block(k20, b_row, b_rk0, False)
    l21 = _l_block(k21, b_row, b_rk1, False)
    b_x = tl.dot(l21, t10, tl.dot(l20, t00, input_precision=SOLVE), input_precision=SOLVE)
    t20 = -tl.dot(t22, b_x, input_precision=SOLVE)
    t21 = -tl.dot(t22, tl.dot(l21, t11, input_precision=SOLVE), input_precision=SOLVE)
    _store_block(tinv, t20, r2, 0, t_end, H * 64)
    _store_block(tinv, t21, r2, 16, t_end, H * 64)

    b_rq = _row_vec(rq, r3, t_end, H)
    _store_aqk(aqk, a30, b_rq, b_rk0, r3, 0, t_end, H, False)
    _store_aqk(aqk, a31, b_rq, b_rk1, r3, 16, t_end, H, False)
    _store_aqk(aqk, a32, b_rq, b_rk2, r3, 32, t_end, H, False)
    b_row = _row_vec(beta, r3, t_end, stride_b) * b_rk3
    l30 = _l_block(k30, b_row, b_rk0, False)
    l31 = _l_block(k31, b_row, b_rk1, False)
    l32 = _l_block(k32, b_row, b_rk2, False)
    b_x = tl.dot(l31, t10, tl.dot(l30, t00, input_precision=SOLVE), input_precision=SOLVE)
    b_x = tl.dot(l32, t20, b_x, input_precision=SOLVE)
    _store_block(tinv, -tl.dot(t33, b_x, input_precision=SOLVE), r3, 0, t_end, H * 64)
    b_x = tl.dot(l32, t21, tl.dot(l31, t11, input_precision=SOLVE), input_precision=SOLVE)
    _store_block(tinv, -tl.dot(t33, b_x, input_precision=SOLVE), r3, 16, t_end, H * 64)
    b_x = tl.dot(l32, t22, input_precision=SOLVE)
    _store_block(tinv, -tl.dot(t33, b_x, input_precision=SOLVE), r3, 32, t_end, H * 64)
