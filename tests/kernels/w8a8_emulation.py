"""The W8A8 numerics of the FP8-activation kernels, emulated in PyTorch (fp32 products of the
dequantised operands): what the kernels must equal up to fp32 summation order, while the
fp32 references (ref.py) differ from both by the activation quantisation itself."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmflash.kernels.fp8_gemm import dequantize_block_fp8

FP8_MAX = 448.0


def quantize_rows(x: torch.Tensor, block: int = 128) -> torch.Tensor:
    """x `[M, K]` rounded as the kernels' quantiser does, per row and `block` channels: scale =
    amax / 448 (at least 1e-12 / 448), e4m3 code = x / scale to nearest; returned dequantised,
    fp32."""
    x = x.float()
    out = torch.empty_like(x)
    for k0 in range(0, x.shape[1], block):
        part = x[:, k0:k0 + block]
        scale = part.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        out[:, k0:k0 + block] = (part / scale).to(torch.float8_e4m3fn).float() * scale
    return out


def w8a8_linear_emulated(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: int = 128) -> torch.Tensor:
    """`y = quantised(x) W^T` in fp32."""
    return quantize_rows(x, block) @ dequantize_block_fp8(weight, scale_inv, block=block).T


def w8a8_moe_emulated(x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down, *,
                      limit: float, block: int = 128) -> torch.Tensor:
    """`fused_moe_ref` with x quantised per token and h per row, both per `block` channels;
    fp32 `[T, D]`."""
    xq = quantize_rows(x, block)
    out = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float32, device=x.device)
    for e in ids.unique().tolist():
        if e < 0:
            continue
        rows, slots = torch.nonzero(ids == e, as_tuple=True)
        gate = xq[rows] @ dequantize_block_fp8(w_gate[e], s_gate[e], block=block).T
        up = xq[rows] @ dequantize_block_fp8(w_up[e], s_up[e], block=block).T
        h = F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
        y = quantize_rows(h, block) @ dequantize_block_fp8(w_down[e], s_down[e], block=block).T
        out.index_add_(0, rows, weights[rows, slots].float()[:, None] * y)
    return out
