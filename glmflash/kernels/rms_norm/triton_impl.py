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
    for r in range(ROWS):
        row = i_r * ROWS + r
        if row < num_rows:
            norm_row(x + row.to(tl.int64) * stride_x, weight, out + row.to(tl.int64) * stride_o,
                     D, eps, HAS_WEIGHT, BD)


@jit
def norm_row(x, weight, out, D, eps, HAS_WEIGHT: tl.constexpr, BD: tl.constexpr):
    """One row of D values at x into out (the reference's two roundings)."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_x = tl.load(x + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = (b_x * tl.rsqrt(tl.sum(b_x * b_x, 0) / D + eps)).to(out.dtype.element_ty)
    if HAS_WEIGHT:
        b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_y = (b_w * b_y.to(tl.float32)).to(out.dtype.element_ty)
    tl.store(out + o_d, b_y, mask=m_d)


@jit
def rms_norm_pair_kernel(x, weight_a, weight_b, out_a, out_b, rows_b, A, B, eps_a, eps_b,
                         stride_x, stride_a, stride_b, stride_rows, BA: tl.constexpr,
                         BB: tl.constexpr):
    """Row i of x `[R, A + B]`: its first A values normalised into row i of out_a, its last B
    into row `rows_b[i]` of out_b (a cache written in place)."""
    i = tl.program_id(0).to(tl.int64)
    norm_row(x + i * stride_x, weight_a, out_a + i * stride_a, A, eps_a, True, BA)
    target = tl.load(rows_b + i * stride_rows).to(tl.int64)
    norm_row(x + i * stride_x + A, weight_b, out_b + target * stride_b, B, eps_b, True, BB)


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


def rms_norm_pair(x: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                  weight_b: torch.Tensor, eps_b: float, out_b: torch.Tensor,
                  rows_b: torch.Tensor, *, num_warps: int = 4) -> torch.Tensor:
    """Triton `rms_norm_pair_ref` in one launch."""
    width_a, width_b = weight_a.shape[0], weight_b.shape[0]
    assert x.dim() == 2 and x.shape[1] == width_a + width_b and x.stride(1) == 1
    for w in (weight_a, weight_b):
        assert w.is_contiguous() and w.dtype == x.dtype, "the weight product rounds in x's dtype"
    assert out_b.dtype == x.dtype and out_b.shape[1] == width_b and out_b.stride(1) == 1
    assert rows_b.shape == (x.shape[0],)
    out_a = torch.empty(x.shape[0], width_a, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        rms_norm_pair_kernel[(x.shape[0],)](
            x, weight_a, weight_b, out_a, out_b, rows_b, width_a, width_b, eps_a, eps_b,
            x.stride(0), out_a.stride(0), out_b.stride(0), rows_b.stride(0),
            BA=triton.next_power_of_2(width_a), BB=triton.next_power_of_2(width_b),
            num_warps=num_warps)
    return out_a
