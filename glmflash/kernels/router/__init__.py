"""MoE routing: `route` (scores, group-limited top-k, weights).

CUDA tensors go to the Triton kernels (triton_impl.py: scores by FMA for decode-sized batches,
the choice in one launch), CPU tensors to ref.py; `GLMFLASH_KERNEL_ROUTER=ref|triton` forces
one. The reference on a GPU spends about fifteen kernels a layer (an fp32 GEMM, three top-k,
scatters, gathers)."""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.router.ref import RouterSpec, route_ref, select_ref


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, spec: RouterSpec,
          weight_fp32: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids `[T, k]` int64, fp32 weights `[T, k]`); see `route_ref`. The Triton scores
    multiply the model-dtype weight exactly in fp32; `weight_fp32` serves the larger batches'
    fp32 GEMM."""
    impl = route_ref
    if use_triton(x, "router"):
        from glmflash.kernels.router.triton_impl import route as impl
    return impl(x, weight, bias, spec=spec, weight_fp32=weight_fp32)


__all__ = ["RouterSpec", "route", "route_ref", "select_ref"]
