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
from glmflash.kernels.swiglu import clamped_swiglu_stacked


def fp8_linear_on_triton(x: torch.Tensor) -> bool:
    """Whether `fp8_linear` of `x` runs a Triton kernel (else the reference: dequantise, then
    a plain product)."""
    return use_triton(x, "fp8_gemm", "fp8_linear")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
               block: int = 128, swiglu_limit: float | None = None) -> torch.Tensor:
    """`y = x W^T` with W in block-scaled FP8; see `fp8_linear_ref`. With `swiglu_limit`, x is
    a stacked [gate | up] product and y the product of its clamped SwiGLU
    (`clamped_swiglu_stacked`), which the Triton one-row kernel forms as it reads x (up to
    `Fp8LinearConfig.swiglu_fold_max_k`; other shapes apply it first)."""
    if fp8_linear_on_triton(x):
        from glmflash.kernels.fp8_gemm import triton_impl

        return triton_impl.fp8_linear(x, weight, scale_inv, block=block,
                                      swiglu_limit=swiglu_limit)
    if swiglu_limit is not None:
        x = clamped_swiglu_stacked(x, swiglu_limit)
    return fp8_linear_ref(x, weight, scale_inv, block=block)


__all__ = ["FP8_DTYPE", "block_scale_shape", "dequantize_block_fp8", "fp8_linear",
           "fp8_linear_on_triton", "fp8_linear_ref", "quantize_block_fp8"]
