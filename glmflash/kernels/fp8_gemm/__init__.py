"""Block-FP8 linear: `fp8_linear(x, weight, scale_inv)`.

CUDA tensors go to the Triton kernels (triton_impl.py: weight-only dequantisation for few rows,
FP8 activations above `FP8_ACT_MIN_ROWS`), CPU tensors to ref.py;
`GLMFLASH_KERNEL_FP8_LINEAR=ref|triton` forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.fp8_gemm.ref import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_block_fp8,
    fp8_linear_ref,
    quantize_block_fp8,
)
from glmflash.utils.env import kernel_override

IMPLS = ("ref", "triton")


def _use_triton(x: torch.Tensor) -> bool:
    choice = kernel_override("fp8_linear")
    if choice is None:
        return x.is_cuda
    if choice not in IMPLS:
        raise ValueError(f"unknown fp8_linear impl {choice!r}; expected one of {IMPLS}")
    return choice == "triton"


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
               block: int = 128) -> torch.Tensor:
    """`y = x W^T` with W in block-scaled FP8; see `fp8_linear_ref`."""
    if _use_triton(x):
        from glmflash.kernels.fp8_gemm import triton_impl

        return triton_impl.fp8_linear(x, weight, scale_inv, block=block)
    return fp8_linear_ref(x, weight, scale_inv, block=block)


__all__ = ["FP8_DTYPE", "block_scale_shape", "dequantize_block_fp8", "fp8_linear",
           "fp8_linear_ref", "quantize_block_fp8"]
