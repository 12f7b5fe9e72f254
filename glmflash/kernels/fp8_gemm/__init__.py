"""Block-FP8 linear: `fp8_linear(x, weight, scale_inv)`; ref dequantises, GPU kernels come later."""

from __future__ import annotations

from glmflash.kernels.fp8_gemm.ref import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_block_fp8,
    fp8_linear_ref,
    quantize_block_fp8,
)

fp8_linear = fp8_linear_ref

__all__ = ["FP8_DTYPE", "block_scale_shape", "dequantize_block_fp8", "fp8_linear",
           "fp8_linear_ref", "quantize_block_fp8"]
