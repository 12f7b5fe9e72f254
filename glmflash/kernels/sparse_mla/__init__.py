"""Sparse MLA over the indexer's selection: `sparse_mla(q_lat, latent, slots, scale=...)`.

CUDA tensors go to the Triton kernel (triton_impl.py), CPU tensors to ref.py;
`GLMFLASH_KERNEL_SPARSE_MLA=ref|triton` forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.sparse_mla.ref import sparse_mla_ref
from glmflash.utils.env import kernel_override

IMPLS = ("ref", "triton")


def _use_triton(x: torch.Tensor) -> bool:
    choice = kernel_override("sparse_mla")
    if choice is None:
        return x.is_cuda
    if choice not in IMPLS:
        raise ValueError(f"unknown sparse_mla impl {choice!r}; expected one of {IMPLS}")
    return choice == "triton"


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
               scale: float) -> torch.Tensor:
    """Absorbed-latent attention over selected slots; see `sparse_mla_ref`."""
    if _use_triton(q_lat):
        from glmflash.kernels.sparse_mla import triton_impl

        return triton_impl.sparse_mla(q_lat, latent, slots, scale=scale)
    return sparse_mla_ref(q_lat, latent, slots, scale=scale)


__all__ = ["sparse_mla", "sparse_mla_ref"]
