"""Which implementation runs an op: Triton for CUDA tensors, the reference otherwise, unless
`GLMFLASH_KERNEL_<OP>=ref|triton` says so."""

from __future__ import annotations

import torch

from glmflash.utils.env import kernel_override

IMPLS = ("ref", "triton")


def use_triton(x: torch.Tensor, *ops: str) -> bool:
    """The first of `ops` with an override decides; without one, CUDA tensors take Triton."""
    choice = next((c for c in map(kernel_override, ops) if c), None)
    if choice is None:
        return x.is_cuda
    if choice not in IMPLS:
        raise ValueError(f"unknown {ops[0]} impl {choice!r}; expected one of {IMPLS}")
    return choice == "triton"
