"""Block-FP8 dequantisation: exact against float64, partial edge blocks included."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.fp8_gemm import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_block_fp8,
    fp8_linear,
    quantize_block_fp8,
)

SHAPES = [(1, 1), (128, 128), (129, 127), (200, 72), (256, 384), (3, 300)]


def _float64_dequant(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out = torch.empty(weight.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = weight[rows, cols].double() * float(scale[i, j])
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("block", [128, 64])
def test_dequantize_is_exact(shape, block, seeded):
    raw = torch.randint(0, 256, shape, dtype=torch.uint8, generator=seeded)
    raw[(raw & 0x7F) == 0x7F] = 0  # e4m3fn NaN codes
    weight = raw.view(FP8_DTYPE)
    scale = torch.rand(block_scale_shape(shape, block), generator=seeded) * 3 + 1e-3
    got = dequantize_block_fp8(weight, scale, block=block)
    want = _float64_dequant(weight, scale, block).float()
    assert torch.equal(got, want)


def test_scale_shape_mismatch_is_rejected():
    weight = torch.zeros(130, 10).to(FP8_DTYPE)
    with pytest.raises(AssertionError, match="scale shape"):
        dequantize_block_fp8(weight, torch.ones(1, 1))


@pytest.mark.parametrize("shape", [(130, 257), (64, 64)], ids=str)
def test_quantize_round_trip_error_is_fp8_rounding(shape, seeded):
    w = torch.randn(shape, generator=seeded)
    q, scale = quantize_block_fp8(w)
    assert q.dtype == FP8_DTYPE and scale.shape == block_scale_shape(shape)
    back = dequantize_block_fp8(q, scale)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values.
    assert ((back - w).abs() <= w.abs() / 16 + scale.max() * 2 ** -9).all()


def test_fp8_linear_matches_dequantised_matmul(seeded):
    w = torch.randn(70, 200, generator=seeded)
    q, scale = quantize_block_fp8(w)
    x = torch.randn(5, 200, generator=seeded)
    assert torch.equal(fp8_linear(x, q, scale), x @ dequantize_block_fp8(q, scale).t())
