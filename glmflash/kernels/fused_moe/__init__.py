"""Routed experts of one MoE layer on the GPU: `fused_moe(x, ids, weights, w_gate, s_gate, ...)`.

CUDA tensors go to the Triton kernels (triton_impl.py: sorted block dispatch, grouped gate/up
and down, a per-token sum; no host sync), CPU tensors to ref.py;
`GLMFLASH_KERNEL_FUSED_MOE=ref|triton` forces one. Scales None: plain (unquantised) weights.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.fused_moe.expert_rows import ExpertRows
from glmflash.kernels.fused_moe.ref import fused_moe_ref


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              s_gate: torch.Tensor | None, w_up: torch.Tensor, s_up: torch.Tensor | None,
              w_down: torch.Tensor, s_down: torch.Tensor | None, *, limit: float,
              block: int = 128, rows: bool = False) -> torch.Tensor | ExpertRows:
    """Sum over each token's experts (ids < 0 skipped) of weight * clamped-SwiGLU expert;
    see `fused_moe_ref`. `rows`: on the Triton path the pairs' rows before that sum
    (`ExpertRows`), for a consumer that forms it as it reads them; the reference sums."""
    args = (x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down)
    if use_triton(x, "fused_moe"):
        from glmflash.kernels.fused_moe import triton_impl

        return triton_impl.fused_moe(*args, limit=limit, block=block, rows=rows)
    return fused_moe_ref(*args, limit=limit, block=block)


__all__ = ["ExpertRows", "fused_moe", "fused_moe_ref"]
