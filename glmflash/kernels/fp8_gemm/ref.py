"""FP8 e4m3 weights with one fp32 scale per 128x128 block (spec/model.md §7.4).

W[n, k] = fp8[n, k] * scale_inv[n // block, k // block]; edge blocks may be partial.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def block_scale_shape(shape: tuple[int, ...], block: int = 128) -> tuple[int, ...]:
    """Scale shape of a weight `[..., N, K]`: `[..., ceil(N/block), ceil(K/block)]`."""
    *lead, n, k = shape
    return (*lead, -(-n // block), -(-k // block))


def expand_block_scales(scale_inv: torch.Tensor, n: int, k: int, block: int = 128) -> torch.Tensor:
    """Repeat each block scale over its block and crop the partial edge: `[..., N, K]`."""
    full = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return full[..., :n, :k]


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, *, block: int = 128,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`[..., N, K]` FP8 + `[..., ceil(N/b), ceil(K/b)]` fp32 scales -> `[..., N, K]` in `dtype`."""
    n, k = weight.shape[-2:]
    assert scale_inv.shape == block_scale_shape(tuple(weight.shape), block), (
        f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)}")
    # NOTE: one correctly rounded fp32 product per element, so it equals the float64 product
    # rounded to fp32 (tested); casting to bf16 afterwards is a second rounding.
    values = weight.to(torch.float32) * expand_block_scales(scale_inv.float(), n, k, block)
    return values.to(dtype)


def quantize_block_fp8(weight: torch.Tensor, *, block: int = 128
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Round `[..., N, K]` to FP8, one amax-derived scale per block; returns (fp8, scale_inv)."""
    n, k = weight.shape[-2:]
    w = weight.float()
    pad_n, pad_k = -n % block, -k % block
    padded = torch.nn.functional.pad(w, (0, pad_k, 0, pad_n))
    lead = padded.shape[:-2]
    tiles = padded.reshape(*lead, (n + pad_n) // block, block, (k + pad_k) // block, block)
    amax = tiles.abs().amax(dim=(-3, -1)).clamp_min(1e-12)
    scale_inv = (amax / FP8_MAX).float()
    q = (w / expand_block_scales(scale_inv, n, k, block)).clamp(-FP8_MAX, FP8_MAX)
    return q.to(FP8_DTYPE), scale_inv


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
                   block: int = 128) -> torch.Tensor:
    """`y = x W^T` with W dequantised to x's dtype (the reference's CPU path)."""
    w = dequantize_block_fp8(weight, scale_inv, block=block, dtype=x.dtype)
    return torch.nn.functional.linear(x, w)
