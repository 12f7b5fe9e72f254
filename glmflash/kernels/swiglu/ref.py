"""The clamped SwiGLU of GLM's MLPs (spec/model.md §5.1), as the reference computes it."""

from __future__ import annotations

import torch
from torch import nn


def clamped_swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """`silu(min(gate, L)) * clip(up, -L, L)`: the clamp acts on the pre-activations; in the
    inputs' dtype, rounded after the silu and after the product (as torch's ops round)."""
    return nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
