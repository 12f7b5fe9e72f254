"""Block-FP8 GEMM (W8A8) with TMA tile loads and Triton's automatic warp specialisation.

The same product as `triton_impl.fp8_gemm_kernel`: `y = sum_kb (xq_kb W_kb^T) * xs[:, kb] *
ws[n // 128, kb]`. Each 128-wide K block has its own scales, so every block's fp32 partial is
rescaled before it joins the accumulator; in one warpgroup that rescale waits for the block's
product. With `warp_specialize` on the K loop, Triton (sm_90: Meta's Hopper pass, from Triton
3.6) splits the program into a producer warp group issuing the TMA loads and two consumer
warpgroups, each owning half of the tile's rows: while one rescales its partial the other's
product runs, as DeepGEMM's hand-written kernels do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import grouped_tile, jit


@dataclass(frozen=True)
class WsGemmConfig:
    """Launch shape of the warp-specialised GEMM."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 4
    """Warps of one consumer partition (the program runs three times as many with the
    producer and the second consumer)."""
    num_stages: int = 4
    warp_specialize: bool = True


@jit
def fp8_gemm_ws_kernel(x_desc, w_desc, xs, ws, y, M, N, K, stride_sm, stride_wsn, stride_ym,
                       BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       GROUP_M: tl.constexpr, WS: tl.constexpr):
    """y[BM rows, BN columns] of one program; TMA zero-fills the tiles past M, N and K."""
    pid = tl.program_id(0)
    i_m, i_n = grouped_tile(pid, tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    p_xs = xs + o_m.to(tl.int64) * stride_sm
    p_ws = ws + (o_n // BLOCK) * stride_wsn
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, warp_specialize=WS):
        b_x = x_desc.load([i_m * BM, k0])
        b_w = w_desc.load([i_n * BN, k0])
        b_xs = tl.load(p_xs + k0 // BLOCK, mask=m_m, other=0.0)
        b_ws = tl.load(p_ws + k0 // BLOCK, mask=m_n, other=0.0)
        b_acc += tl.dot(b_x, tl.trans(b_w)) * (b_xs[:, None] * b_ws[None, :])
    p_y = y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def fp8_gemm_ws(xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor,
                scale_inv: torch.Tensor, out_dtype: torch.dtype, block: int,
                config: WsGemmConfig = WsGemmConfig()) -> torch.Tensor:
    """e4m3 `[M, K]` with scales `[M, K / block]` times block-FP8 `[N, K]` -> `[M, N]`."""
    m, k = xq.shape
    n = weight.shape[0]
    assert k % 16 == 0, "TMA needs 16-byte row strides"
    bm, bn = config.block_m, config.block_n
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    x_desc = TensorDescriptor.from_tensor(xq, [bm, block])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, block])
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fp8_gemm_ws_kernel[grid](x_desc, w_desc, xs, scale_inv, out, m, n, k, xs.stride(0),
                             scale_inv.stride(0), out.stride(0), BLOCK=block, BM=bm, BN=bn,
                             GROUP_M=8, WS=config.warp_specialize, num_warps=config.num_warps,
                             num_stages=config.num_stages)
    return out


__all__ = ["WsGemmConfig", "fp8_gemm_ws", "fp8_gemm_ws_kernel"]
