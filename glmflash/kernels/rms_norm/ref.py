"""RMSNorm as the reference computes it (spec/model.md §2.4)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to x's dtype, then scale by the weight in the model dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def rms_norm_pair_ref(x: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                      weight_b: torch.Tensor, eps_b: float, out_b: torch.Tensor,
                      rows_b: torch.Tensor) -> torch.Tensor:
    """Two RMSNorms of one row's halves `x` `[R, A + B]`: the first A values' norm is returned,
    the last B values' is written into rows `rows_b` of `out_b` (in its dtype)."""
    width_a = weight_a.shape[0]
    out_b[rows_b] = rms_norm_ref(x[:, width_a:], weight_b, eps_b).to(out_b.dtype)
    return rms_norm_ref(x[:, :width_a], weight_a, eps_a)
