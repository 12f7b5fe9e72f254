"""The gate stage and the diagonal blocks of the KDA prefill's intra stage in one program per
(chunk, head) (StagedConfig.diag_form == "chunk"): the chunk's four 16-row sub-chunks are the
batch of `[4, 16, BK]` tiles, so the decay's cumulative sum runs over the whole chunk once and
the four diagonal products, and the four 16x16 inverses, are batched `tl.dot`s (one warp a
sub-chunk at 4 warps). It stores what `kda_gate_kernel` and `kda_intra_diag_kernel` store.
"""

from __future__ import annotations

try:
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    tl = None

from glmflash.kernels.kda.chunk_intra import SAFE_SPAN, _unit_upper_inverse
from glmflash.kernels.kda.chunk_walk import RCP_LN2
from glmflash.kernels.triton_utils import jit


@jit
def _sub_chunk_rows(t0):
    """Row of each (sub-chunk, row) of the chunk starting at t0, `[4, 16]`."""
    return t0 + tl.arange(0, 4)[:, None] * 16 + tl.arange(0, 16)[None, :]


@jit
def _load_sub_chunks(ptr, rows, t_end, stride, c0, K: tl.constexpr, BK: tl.constexpr):
    """`[4, 16, BK]` of a row-major matrix at `rows` `[4, 16]`, channels c0.., zero past t_end
    or K, as fp32."""
    o_c = c0 + tl.arange(0, BK)[None, None, :]
    m = (rows < t_end)[:, :, None] & (o_c < K)
    p = ptr + rows.to(tl.int64)[:, :, None] * stride + o_c
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@jit
def _store_sub_chunks(ptr, b_x, rows, t_end, stride, c0, K: tl.constexpr, BK: tl.constexpr):
    """Stores `[4, 16, BK]` at `rows`, channels c0.., rows past t_end and channels past K left
    alone."""
    o_c = c0 + tl.arange(0, BK)[None, None, :]
    m = (rows < t_end)[:, :, None] & (o_c < K)
    tl.store(ptr + rows.to(tl.int64)[:, :, None] * stride + o_c,
             b_x.to(ptr.dtype.element_ty), mask=m)


@jit
def _sub_row(x, r):
    """Row r of every sub-chunk of a `[4, 16, N]` tile, `[4, N]`."""
    return tl.sum(tl.where(tl.arange(0, 16)[None, :, None] == r, x, 0.0), 1)


@jit
def _chunk_decay(g, rows, t_end, stride_g, c0, K: tl.constexpr, BK: tl.constexpr):
    """G `[4, 16, BK]` from the chunk start in log2 units: each sub-chunk's cumulative sum plus
    the earlier sub-chunks' totals. Rows past t_end add nothing, so they repeat the last row's
    G (as `_g_row`'s clamp does)."""
    b_g = _load_sub_chunks(g, rows, t_end, stride_g, c0, K, BK) * RCP_LN2
    b_total = tl.sum(b_g, 1)
    b_start = tl.cumsum(b_total, 0) - b_total
    return tl.cumsum(b_g, 1) + b_start[:, None, :]


@jit
def _batched_diag_products(b_aq, b_akk, b_q, b_k, b_g, m_r, PREC: tl.constexpr):
    """`_diag_products` for the four sub-chunks at once: each channel anchored at its middle
    decay across its sub-chunk; channels steeper than SAFE_SPAN left out. Returns the
    products and each sub-chunk's steepest span."""
    b_first = _sub_row(b_g, 0)
    b_last = _sub_row(b_g, 15)
    b_mid = (0.5 * (b_first + b_last))[:, None, :]
    m = m_r[:, :, None] & ((b_first - b_last) <= SAFE_SPAN)[:, None, :]
    b_up = tl.where(m, tl.exp2(b_g - b_mid), 0.0)
    b_kt = tl.permute(b_k * tl.where(m, tl.exp2(b_mid - b_g), 0.0), (0, 2, 1))
    b_aq = tl.dot(b_q * b_up, b_kt, b_aq, input_precision=PREC)
    b_akk = tl.dot(b_k * b_up, b_kt, b_akk, input_precision=PREC)
    return b_aq, b_akk, tl.max(b_first - b_last, 1)


@jit
def _batched_steep(b_aq, b_akk, q, k, g2, rows, t_end, stride_q, stride_k, H: tl.constexpr,
                   K: tl.constexpr, BK: tl.constexpr):
    """Adds the steep channels' (span > SAFE_SPAN) share of every sub-chunk's diagonal blocks
    with exact decays exp2(G_t - G_s), one key row at a time (`_steep_diag`, batched)."""
    o_r = tl.arange(0, 16)
    m_r = rows < t_end
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_q = _load_sub_chunks(q, rows, t_end, stride_q, c0, K, BK)
        b_k = _load_sub_chunks(k, rows, t_end, stride_k, c0, K, BK)
        # rows past t_end read the last row's G, as the cumulative sum left it
        b_g = _load_sub_chunks(g2, tl.minimum(rows, t_end - 1), t_end, H * K, c0, K, BK)
        b_steep = (_sub_row(b_g, 0) - _sub_row(b_g, 15) > SAFE_SPAN)[:, None, :]
        for c in range(16):
            b_kc = _sub_row(b_k, c)[:, None, :]
            b_gc = _sub_row(b_g, c)[:, None, :]
            m = (m_r & (o_r >= c)[None, :])[:, :, None] & b_steep
            b_d = tl.exp2(tl.where(m, b_g - b_gc, float("-inf"))) * b_kc
            m_col = o_r[None, None, :] == c
            b_aq = tl.where(m_col, b_aq + tl.sum(b_q * b_d, 2)[:, :, None], b_aq)
            b_akk = tl.where(m_col, b_akk + tl.sum(b_k * b_d, 2)[:, :, None], b_akk)
    return b_aq, b_akk


@jit
def _store_diag_blocks(ptr, b_x, rows, t_end, stride, WIDE: tl.constexpr):
    """Stores the four 16x16 blocks at their rows: at columns 16 s.. of a 64-wide row when
    WIDE (Aqk, T), else at columns 0..15 (T's diagonal copy)."""
    o_c = tl.arange(0, 16)[None, None, :]
    if WIDE:
        o_c = o_c + tl.arange(0, 4)[:, None, None] * 16
    tl.store(ptr + rows.to(tl.int64)[:, :, None] * stride + o_c,
             b_x.to(ptr.dtype.element_ty), mask=(rows < t_end)[:, :, None])


@jit
def _norm_factors(rq, rk, b_nq, b_nk, scale, rows, t_end, i_h, H: tl.constexpr):
    """scale / |q| and 1 / |k| `[4, 16]` from the squared norms (eps inside the root, as the
    reference), stored at `[row, i_h]` and returned, zero past t_end."""
    m_r = rows < t_end
    b_rq = tl.where(m_r, scale / tl.sqrt(b_nq + 1e-6), 0.0)
    b_rk = tl.where(m_r, 1.0 / tl.sqrt(b_nk + 1e-6), 0.0)
    p = rows.to(tl.int64) * H + i_h
    tl.store(rq + p, b_rq, mask=m_r)
    tl.store(rk + p, b_rk, mask=m_r)
    return b_rq, b_rk


@jit
def _batched_inverse(b_akk, b_row, b_rk, SOLVE: tl.constexpr):
    """(I + L_ii)^-1 of the four diagonal blocks, L_ii = diag(b_row) Akk_ii diag(b_rk)
    strictly lower (`_diag_inverse`, batched)."""
    o_r = tl.arange(0, 16)[None, :, None]
    o_c = tl.arange(0, 16)[None, None, :]
    b_l = tl.where(o_r > o_c, b_akk * b_row[:, :, None] * b_rk[:, None, :], 0.0)
    b_t = _unit_upper_inverse(tl.permute(b_l, (0, 2, 1)), o_r, o_c, SOLVE)
    return tl.permute(b_t, (0, 2, 1))


@jit
def kda_chunk_diag_kernel(q, k, g, g2, rq, rk, beta, aqk, tinv, tdiag, meta, scale, stride_q,
                          stride_k, stride_g, stride_b, H: tl.constexpr, K: tl.constexpr,
                          BK: tl.constexpr, PREC: tl.constexpr, SOLVE: tl.constexpr):
    """One (chunk, head): G from g (stored to g2), scale / |q| and 1 / |k|, then each
    sub-chunk's diagonal block of Aqk (scaled, normalised, causal) and T_ii = (I + L_ii)^-1,
    stored in tinv and, fp32, in tdiag `[T, H, 16]` for `kda_intra_off_kernel`."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    q += i_h * K
    k += i_h * K
    g += i_h * K
    g2 += i_h * K
    rows = _sub_chunk_rows(t0)
    m_r = rows < t_end
    b_a = tl.zeros([4, 16, 16], dtype=tl.float32)
    b_akk = b_a
    b_nq = tl.zeros([4, 16], dtype=tl.float32)
    b_nk = b_nq
    b_span = tl.zeros([4], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        b_g = _chunk_decay(g, rows, t_end, stride_g, c0, K, BK)
        _store_sub_chunks(g2, b_g, rows, t_end, H * K, c0, K, BK)
        b_q = _load_sub_chunks(q, rows, t_end, stride_q, c0, K, BK)
        b_k = _load_sub_chunks(k, rows, t_end, stride_k, c0, K, BK)
        b_nq += tl.sum(b_q * b_q, 2)
        b_nk += tl.sum(b_k * b_k, 2)
        b_a, b_akk, b_s = _batched_diag_products(b_a, b_akk, b_q, b_k, b_g, m_r, PREC)
        b_span = tl.maximum(b_span, b_s)
    if tl.max(b_span, 0) > SAFE_SPAN:
        # NOTE: the steep form reads back the G this program's threads stored.
        tl.debug_barrier()
        b_a, b_akk = _batched_steep(b_a, b_akk, q, k, g2, rows, t_end, stride_q, stride_k, H,
                                    K, BK)
    b_rq, b_rk = _norm_factors(rq, rk, b_nq, b_nk, scale, rows, t_end, i_h, H)
    o_i = tl.arange(0, 16)
    b_a = b_a * b_rq[:, :, None] * b_rk[:, None, :]
    b_a = tl.where((o_i[:, None] >= o_i[None, :])[None, :, :], b_a, 0.0)
    _store_diag_blocks(aqk + i_h * 64, b_a, rows, t_end, H * 64, True)
    b_b = tl.load(beta + rows.to(tl.int64) * stride_b + i_h, mask=m_r, other=0.0)
    b_t = _batched_inverse(b_akk, b_b.to(tl.float32) * b_rk, b_rk, SOLVE)
    _store_diag_blocks(tinv + i_h * 64, b_t, rows, t_end, H * 64, True)
    _store_diag_blocks(tdiag + i_h * 16, b_t, rows, t_end, H * 16, False)
