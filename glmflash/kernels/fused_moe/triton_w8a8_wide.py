"""The W8A8 grouped GEMMs with one product per K block (`W8A8MoeConfig.wide`): the program's
weight rows form one [256, BK] tile, so each K block is a single tensor-core product whose fp32
partial is promoted with a per-row x per-column scale.

- gate/up: the 128 gate rows and the 128 up rows of the program's columns of I, interleaved
  (tile row 2j is gate row j, row 2j + 1 up row j), so the accumulator's column pairs split
  into gate and up in registers (`tl.split`) for the clamped SwiGLU;
- down: 256 contiguous rows of W_down (two scale blocks).

With DEFER each block's partial is promoted one iteration late, so the one product in flight
runs under the FMAs of the previous block (one async product per loop, carried across the back
edge). Numerics and outputs as triton_w8a8.py: x and h in e4m3 per 128 channels, fp32
accumulation in K order.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import quantize_rows
from glmflash.kernels.triton_utils import jit


@jit
def _scaled_dot_wide(p_a, p_as, m_r, p_b, p_bs, m_n, K, BLOCK: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, DEFER: tl.constexpr):
    """sum over K of (A_kb B_kb^T) * a_s[:, kb] * b_s[:, kb]^T: A `[BM, K]` e4m3 rows (p_a: row
    pointers at column 0, p_as: their scales), B `[BN, K]` e4m3 rows (p_b: row pointers at
    column 0, zero where not m_n; p_bs: each row's scale row)."""
    o_k = tl.arange(0, BK)
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    b_prev = tl.zeros([BM, BN], dtype=tl.float32)
    b_prev_as = tl.zeros([BM], dtype=tl.float32)
    b_prev_bs = tl.zeros([BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = k0 + o_k < K
        kb = k0 // BLOCK
        b_a = tl.load(p_a[:, None] + k0 + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                      other=0.0)  # [BM, BK]
        b_b = tl.load(p_b[:, None] + k0 + o_k[None, :], mask=m_n[:, None] & m_k[None, :],
                      other=0.0)  # [BN, BK]
        b_as = tl.load(p_as + kb, mask=m_r, other=0.0)  # [BM]
        b_bs = tl.load(p_bs + kb, mask=m_n, other=0.0)  # [BN]
        b_d = tl.dot(b_a, tl.trans(b_b))  # [BM, BN]
        if DEFER:
            b_acc += b_prev * (b_prev_as[:, None] * b_prev_bs[None, :])
            b_prev, b_prev_as, b_prev_bs = b_d, b_as, b_bs
        else:
            b_acc += b_d * (b_as[:, None] * b_bs[None, :])
    if DEFER:
        b_acc += b_prev * (b_prev_as[:, None] * b_prev_bs[None, :])
    return b_acc


@jit
def _tile_of(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid`, GROUP_M row blocks per column sweep."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@jit
def fused_moe_w8a8_gate_up_wide_kernel(xq, xs, sorted_pairs, block_expert, w_gate, s_gate, w_up,
                                       s_up, hq, hs, up_delta, s_up_delta, num_pairs,
                                       num_blocks, N, K, limit,
                                       stride_xm, stride_xsm, stride_we, stride_wn, stride_se,
                                       stride_sn, stride_hm, stride_hsm, TOP_K: tl.constexpr,
                                       BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                       GROUP_M: tl.constexpr, DEFER: tl.constexpr):
    """triton_w8a8's gate/up kernel (same grid and outputs) with gate and up as one product.
    `w_up` / `s_up` are reached as `w_gate + up_delta` / `s_gate + s_up_delta` (elements), so a
    tile row's pointer is one base plus an offset (contiguity stays visible to the compiler)."""
    i_b, i_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK), GROUP_M)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_r)
    m_r = b_pair < num_pairs
    o_t = tl.where(m_r, b_pair // TOP_K, 0).to(tl.int64)
    o_j = tl.arange(0, 2 * BLOCK)
    o_n = i_n * BLOCK + o_j // 2  # [2 * BLOCK], the column of I of each tile row
    m_n = o_n < N
    is_up = (o_j % 2).to(tl.int64)
    p_b = w_gate + e.to(tl.int64) * stride_we + o_n.to(tl.int64) * stride_wn + is_up * up_delta
    p_bs = s_gate + e.to(tl.int64) * stride_se + i_n * stride_sn + is_up * s_up_delta
    b_acc = _scaled_dot_wide(xq + o_t * stride_xm, xs + o_t * stride_xsm, m_r, p_b, p_bs, m_n,
                             K, BLOCK, BM, 2 * BLOCK, BK, DEFER)  # [BM, 2 * BLOCK]
    b_gate, b_up = tl.split(tl.reshape(b_acc, [BM, BLOCK, 2]))
    b_gate = tl.minimum(b_gate, limit)
    b_up = tl.minimum(tl.maximum(b_up, -limit), limit)
    # Columns past N have zero weights, so h is 0 there and leaves the row's amax alone.
    b_hq, b_hs = quantize_rows(b_gate * tl.sigmoid(b_gate) * b_up, hq.dtype.element_ty)
    o_c = i_n * BLOCK + tl.arange(0, BLOCK)
    p_h = hq + o_r[:, None].to(tl.int64) * stride_hm + o_c[None, :]
    tl.store(p_h, b_hq, mask=m_r[:, None] & (o_c < N)[None, :])
    tl.store(hs + o_r.to(tl.int64) * stride_hsm + i_n, b_hs, mask=m_r)


@jit
def fused_moe_w8a8_down_wide_kernel(hq, hs, sorted_pairs, block_expert, w, s, y, num_pairs,
                                    num_blocks, N, K, stride_hm, stride_hsm, stride_we,
                                    stride_wn, stride_se, stride_sn, stride_ym,
                                    BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                    GROUP_M: tl.constexpr, DEFER: tl.constexpr):
    """triton_w8a8's down kernel (same grid and outputs) with its 2 * BLOCK columns as one
    product."""
    i_b, i_n = _tile_of(tl.program_id(0), num_blocks, tl.cdiv(N, 2 * BLOCK), GROUP_M)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_r)
    m_r = b_pair < num_pairs
    o_n = 2 * i_n * BLOCK + tl.arange(0, 2 * BLOCK)
    m_n = o_n < N
    p_b = w + e.to(tl.int64) * stride_we + o_n.to(tl.int64) * stride_wn
    p_bs = s + e.to(tl.int64) * stride_se + (o_n // BLOCK) * stride_sn
    b_y = _scaled_dot_wide(hq + o_r.to(tl.int64) * stride_hm, hs + o_r.to(tl.int64) * stride_hsm,
                           m_r, p_b, p_bs, m_n, K, BLOCK, BM, 2 * BLOCK, BK, DEFER)
    p_y = y + tl.where(m_r, b_pair, 0)[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


__all__ = ["fused_moe_w8a8_down_wide_kernel", "fused_moe_w8a8_gate_up_wide_kernel"]
