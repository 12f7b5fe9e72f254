"""MoE routing: `route` (scores, group-limited top-k, weights).

CUDA tensors go to the Triton kernels (triton_impl.py: scores by FMA for decode-sized batches,
the choice in one launch), CPU tensors to ref.py; `GLMFLASH_KERNEL_ROUTER=ref|triton` forces
one. The reference on a GPU spends about fifteen kernels a layer (an fp32 GEMM, three top-k,
scatters, gathers)."""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.router.ref import RouterSpec, route_ref, select_ref


def route(x: torch.Tensor, weight: torch.Tensor, weight_fp32, bias: torch.Tensor,
          spec: RouterSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids `[T, k]` int64, fp32 weights `[T, k]`); see `route_ref`. `weight` is the
    router weight in the model's dtype; `weight_fp32()` returns its fp32 copy (the reference
    path asks for it; the Triton scores multiply the model-dtype weight exactly in fp32)."""
    if use_triton(x, "router"):
        from glmflash.kernels.router import triton_impl

        return triton_impl.route(x, weight, weight_fp32, bias, spec)
    return route_ref(x, weight_fp32(), bias, spec)


__all__ = ["RouterSpec", "route", "route_ref", "select_ref"]
