"""RMSNorm as the reference computes it (spec/model.md §2.4)."""

from __future__ import annotations

import torch


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back to x's dtype, then scale by the weight in the model dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y
