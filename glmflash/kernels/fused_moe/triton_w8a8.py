"""The prefill form of the grouped MoE on FP8 tensor cores (W8A8, DeepSeek numerics): both
products take e4m3 operands, with fp32 accumulation and both scales applied per K block.

Launches (README.md has the layout and the numerics):
1. `fused_moe_align_kernel` (triton_impl.py): the pairs sorted by expert into BLOCK_M-row groups;
2. `fp8_act_quant_kernel` (fp8_gemm): x per token and 128-channel block to e4m3, scales
   `[T, D/128]` row-major (a row's scales in one 128-byte line: each GEMM row reads them all);
3. `fused_moe_w8a8_gate_up_kernel`: per row block and 128 columns of I, gate and up over the
   gathered token rows, the clamped SwiGLU, and h quantised per row over those 128 columns
   (one program's columns are one scale block of the down projection);
4. `fused_moe_w8a8_down_kernel`: h W_down^T, 256 columns per program, one row per pair;
5. `fused_moe_sum_kernel` (expert_rows.py): each token's pairs times their routing weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import quantize_rows
from glmflash.kernels.swiglu.triton_impl import clamp_gate_up
from glmflash.kernels.triton_utils import grouped_tile, jit


@dataclass(frozen=True)
class W8A8MoeConfig:
    """Launch shape of the two FP8 grouped GEMMs. Each program computes two [BLOCK_M, 128]
    tiles (gate and up; two adjacent column blocks of the down projection)."""

    block_m: int = 64
    """Rows per block; each expert's pairs are padded to a multiple of it."""
    block_k: int = 128
    """Reduction step; divides the scale block."""
    group_m: int = 8
    """Row blocks that walk the column tiles together (weight and row tiles stay in L2)."""
    gate_up_warps: int = 8
    gate_up_stages: int = 3
    down_warps: int = 8
    down_stages: int = 3


W8A8_CONFIG = W8A8MoeConfig()


@jit
def _scaled_dot_pair(p_a, p_as, m_r, p_b0, p_b1, p_bs0, p_bs1, m_n0, m_n1, n1, N, K,
                     BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
    """sum over K of (A_kb B0_kb^T) * a_s[:, kb] * b0_s[kb] and likewise for B1: A `[BM, K]`
    e4m3 rows (p_a: row pointers at column 0, p_as: their scales), B0/B1 `[BN, K]` e4m3
    weight tiles each inside one scale block row (p_bs*: that row of scales; B1's first
    column is n1, and B1 is all zero from N)."""
    o_k = tl.arange(0, BK)
    # NOTE: the weight scales are loaded as [BM] vectors (every lane the same address): a
    # scalar scale load in a pipelined loop is a known miscompile (spec/kernels.md §4).
    o_zero = tl.zeros([BM], dtype=tl.int32)
    m_s1 = o_zero + n1 < N
    b_acc0 = tl.zeros([BM, BN], dtype=tl.float32)
    b_acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = k0 + o_k < K
        kb = k0 // BLOCK
        b_a = tl.load(p_a + k0, mask=m_r[:, None] & m_k[None, :], other=0.0)  # [BM, BK]
        b_b0 = tl.load(p_b0 + k0, mask=m_n0[:, None] & m_k[None, :], other=0.0)  # [BN, BK]
        b_b1 = tl.load(p_b1 + k0, mask=m_n1[:, None] & m_k[None, :], other=0.0)  # [BN, BK]
        b_as = tl.load(p_as + kb, mask=m_r, other=0.0)  # [BM]
        b_bs0 = tl.load(p_bs0 + kb + o_zero)  # [BM]
        b_bs1 = tl.load(p_bs1 + kb + o_zero, mask=m_s1, other=0.0)  # [BM]
        b_d0 = tl.dot(b_a, tl.trans(b_b0))  # [BM, BN]
        b_d1 = tl.dot(b_a, tl.trans(b_b1))
        b_acc0 += b_d0 * (b_as * b_bs0)[:, None]
        b_acc1 += b_d1 * (b_as * b_bs1)[:, None]
    return b_acc0, b_acc1


@jit
def fused_moe_w8a8_gate_up_kernel(xq, xs, sorted_pairs, block_expert, w_gate, s_gate, w_up,
                                  s_up, hq, hs, num_pairs, num_blocks, N, K, limit, stride_xm,
                                  stride_xsm, stride_we, stride_wn, stride_se, stride_sn,
                                  stride_hm, stride_hsm, TOP_K: tl.constexpr,
                                  BLOCK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
                                  GROUP_M: tl.constexpr):
    """h = silu(min(x Wg^T, L)) * clip(x Wu^T, -L, L) for one row block and BLOCK columns,
    stored in e4m3 with one scale per row (over these columns); a block without an expert
    returns before reading any weight."""
    i_b, i_n = grouped_tile(tl.program_id(0), num_blocks, tl.cdiv(N, BLOCK), GROUP_M)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_r)
    m_r = b_pair < num_pairs
    o_t = tl.where(m_r, b_pair // TOP_K, 0).to(tl.int64)
    o_n = i_n * BLOCK + tl.arange(0, BLOCK)
    m_n = o_n < N
    o_k = tl.arange(0, BK)
    p_a = xq + o_t[:, None] * stride_xm + o_k[None, :]
    w_off = e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    s_off = e.to(tl.int64) * stride_se + i_n * stride_sn
    b_gate, b_up = _scaled_dot_pair(p_a, xs + o_t * stride_xsm, m_r, w_gate + w_off,
                                    w_up + w_off, s_gate + s_off, s_up + s_off, m_n, m_n,
                                    i_n * BLOCK, N, K, BLOCK, BM, BLOCK, BK)
    b_gate, b_up = clamp_gate_up(b_gate, b_up, limit)
    # Columns past N have zero weights, so h is 0 there and leaves the row's amax alone.
    b_hq, b_hs = quantize_rows(b_gate * tl.sigmoid(b_gate) * b_up, hq.dtype.element_ty)
    p_h = hq + o_r[:, None].to(tl.int64) * stride_hm + o_n[None, :]
    tl.store(p_h, b_hq, mask=m_r[:, None] & m_n[None, :])
    tl.store(hs + o_r.to(tl.int64) * stride_hsm + i_n, b_hs, mask=m_r)


@jit
def fused_moe_w8a8_down_kernel(hq, hs, sorted_pairs, block_expert, w, s, y, num_pairs,
                               num_blocks, N, K, stride_hm, stride_hsm, stride_we, stride_wn,
                               stride_se, stride_sn, stride_ym, BLOCK: tl.constexpr,
                               BM: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """y[pair, cols] = h[row] W_down^T for one row block and 2 * BLOCK columns, each row into
    its pair's row of y; a block without an expert returns before reading any weight."""
    i_b, i_n = grouped_tile(tl.program_id(0), num_blocks, tl.cdiv(N, 2 * BLOCK), GROUP_M)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_r)
    m_r = b_pair < num_pairs
    o_n0 = 2 * i_n * BLOCK + tl.arange(0, BLOCK)
    o_n1 = o_n0 + BLOCK
    m_n0, m_n1 = o_n0 < N, o_n1 < N
    o_k = tl.arange(0, BK)
    p_a = hq + o_r[:, None].to(tl.int64) * stride_hm + o_k[None, :]
    w_e = w + e.to(tl.int64) * stride_we + o_k[None, :]
    s_e = s + e.to(tl.int64) * stride_se + 2 * i_n * stride_sn
    b_y0, b_y1 = _scaled_dot_pair(p_a, hs + o_r.to(tl.int64) * stride_hsm, m_r,
                                  w_e + o_n0[:, None].to(tl.int64) * stride_wn,
                                  w_e + o_n1[:, None].to(tl.int64) * stride_wn, s_e,
                                  s_e + stride_sn, m_n0, m_n1, (2 * i_n + 1) * BLOCK, N, K,
                                  BLOCK, BM, BLOCK, BK)
    p_y = y + tl.where(m_r, b_pair, 0)[:, None].to(tl.int64) * stride_ym
    tl.store(p_y + o_n0[None, :], b_y0.to(y.dtype.element_ty), mask=m_r[:, None] & m_n0[None, :])
    tl.store(p_y + o_n1[None, :], b_y1.to(y.dtype.element_ty), mask=m_r[:, None] & m_n1[None, :])


def w8a8_experts(xq: torch.Tensor, xs: torch.Tensor, sorted_pairs: torch.Tensor,
                 block_expert: torch.Tensor, top_k: int, w_gate: torch.Tensor,
                 s_gate: torch.Tensor, w_up: torch.Tensor, s_up: torch.Tensor,
                 w_down: torch.Tensor, s_down: torch.Tensor, *, limit: float, block: int,
                 out_dtype: torch.dtype, config: W8A8MoeConfig = W8A8_CONFIG) -> torch.Tensor:
    """Both grouped GEMMs over the sorted layout: quantised tokens `xq` `[T, D]` e4m3 with
    scales `xs` `[T, ceil(D/block)]` -> each pair's expert output `y` `[T * top_k, D]` in
    `out_dtype` (rows of skipped pairs unwritten)."""
    num_tokens, hidden = xq.shape
    inter = w_gate.shape[1]
    bm, bk = config.block_m, min(config.block_k, block)
    assert block % bk == 0 and bm * block_expert.numel() == sorted_pairs.numel()
    num_blocks = block_expert.numel()
    num_pairs = num_tokens * top_k
    hq = torch.empty(num_blocks * bm, inter, dtype=w_down.dtype, device=xq.device)
    hs = torch.empty(num_blocks * bm, triton.cdiv(inter, block), dtype=torch.float32,
                     device=xq.device)
    shape = dict(BLOCK=block, BM=bm, BK=bk, GROUP_M=config.group_m)
    fused_moe_w8a8_gate_up_kernel[(num_blocks * triton.cdiv(inter, block),)](
        xq, xs, sorted_pairs, block_expert, w_gate, s_gate, w_up, s_up, hq, hs, num_pairs,
        num_blocks, inter, hidden, float(limit), xq.stride(0), xs.stride(0), w_gate.stride(0),
        w_gate.stride(1), s_gate.stride(0), s_gate.stride(1), hq.stride(0), hs.stride(0),
        TOP_K=top_k, num_warps=config.gate_up_warps, num_stages=config.gate_up_stages, **shape)
    y = torch.empty(num_pairs, hidden, dtype=out_dtype, device=xq.device)
    fused_moe_w8a8_down_kernel[(num_blocks * triton.cdiv(hidden, 2 * block),)](
        hq, hs, sorted_pairs, block_expert, w_down, s_down, y, num_pairs, num_blocks, hidden,
        inter, hq.stride(0), hs.stride(0), w_down.stride(0), w_down.stride(1),
        s_down.stride(0), s_down.stride(1), y.stride(0), num_warps=config.down_warps,
        num_stages=config.down_stages, **shape)
    return y


__all__ = ["W8A8_CONFIG", "W8A8MoeConfig", "fused_moe_w8a8_down_kernel",
           "fused_moe_w8a8_gate_up_kernel", "w8a8_experts"]
