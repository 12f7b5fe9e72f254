"""The clamped SwiGLU of the MLPs over a stacked [gate | up] product (one product feeds both):
`clamped_swiglu_stacked(gate_up, limit)`. CUDA tensors go to one Triton launch
(triton_impl.py), CPU tensors to ref.py; `GLMFLASH_KERNEL_SWIGLU=ref|triton` forces one."""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.swiglu.ref import clamped_swiglu_ref


def clamped_swiglu_stacked(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """`clamped_swiglu_ref` of the halves of `gate_up` `[T, 2W]` -> `[T, W]`."""
    if use_triton(gate_up, "swiglu"):
        from glmflash.kernels.swiglu import triton_impl

        return triton_impl.clamped_swiglu_stacked(gate_up, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    return clamped_swiglu_ref(gate, up, limit)


__all__ = ["clamped_swiglu_ref", "clamped_swiglu_stacked"]
