"""Triton RMSNorm: one launch, the reference's two roundings (normalised row cast to x's dtype,
then the weight product rounded in the weight's dtype)."""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit


class RmsNormConfig(NamedTuple):
    rows_per_program: int = 1
    num_warps: int = 4


DEFAULT_CONFIG = RmsNormConfig()



@jit
def rms_norm_kernel(x, weight, out, num_rows, D, eps, stride_x, stride_o,
                    HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr):
    """Rows i_r*ROWS .. +ROWS of x `[R, D]`: y = x * rsqrt(mean(x^2) + eps) in fp32, rounded to
    out's dtype, then w * y rounded again (products of two 16-bit values are exact in fp32)."""
    i_r = tl.program_id(0)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if HAS_WEIGHT:
        b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    for r in range(ROWS):
        row = i_r * ROWS + r
        if row < num_rows:
            b_x = tl.load(x + row.to(tl.int64) * stride_x + o_d, mask=m_d, other=0.0)
            b_x = b_x.to(tl.float32)
            b_y = b_x * tl.rsqrt(tl.sum(b_x * b_x, 0) / D + eps)
            b_y = b_y.to(out.dtype.element_ty)
            if HAS_WEIGHT:
                b_y = (b_w * b_y.to(tl.float32)).to(out.dtype.element_ty)
            tl.store(out + row.to(tl.int64) * stride_o + o_d, b_y, mask=m_d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
             config: RmsNormConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Triton `rms_norm_ref` over the last dimension of x (any leading shape)."""
    dim = x.shape[-1]
    assert weight is None or (weight.shape == (dim,) and weight.is_contiguous())
    assert weight is None or weight.dtype == x.dtype, "the weight product rounds in x's dtype"
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, config.rows_per_program),)
        rms_norm_kernel[grid](x2, weight if weight is not None else x2, out, rows, dim, eps,
                              x2.stride(0), out.stride(0), HAS_WEIGHT=weight is not None,
                              ROWS=config.rows_per_program, BD=triton.next_power_of_2(dim),
                              num_warps=config.num_warps)
    return out.view(x.shape)
