"""Block-FP8 linear: `fp8_linear(x, weight, scale_inv)`.

CUDA tensors go to the Triton kernels (triton_impl.py: weight-only dequantisation for few rows,
FP8 activations from `Fp8LinearConfig.act_min_rows`), CPU tensors to ref.py;
`GLMFLASH_KERNEL_FP8_GEMM=ref|triton` (or `GLMFLASH_KERNEL_FP8_LINEAR`) forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.fp8_gemm.ref import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_block_fp8,
    fp8_linear_ref,
    quantize_block_fp8,
)


def fp8_linear_on_triton(x: torch.Tensor) -> bool:
    """Whether `fp8_linear` of `x` runs a Triton kernel (else the reference: dequantise, then
    a plain product)."""
    return use_triton(x, "fp8_gemm", "fp8_linear")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
               block: int = 128) -> torch.Tensor:
    """`y = x W^T` with W in block-scaled FP8; see `fp8_linear_ref`."""
    if fp8_linear_on_triton(x):
        from glmflash.kernels.fp8_gemm import triton_impl

        return triton_impl.fp8_linear(x, weight, scale_inv, block=block)
    return fp8_linear_ref(x, weight, scale_inv, block=block)


__all__ = ["FP8_DTYPE", "block_scale_shape", "dequantize_block_fp8", "fp8_linear",
           "fp8_linear_on_triton", "fp8_linear_ref", "quantize_block_fp8"]
