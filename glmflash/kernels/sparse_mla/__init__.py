"""Sparse MLA over the indexer's selection: `sparse_mla(q_lat, latent, slots, scale=...)`.

CUDA tensors go to the Triton kernel (triton_impl.py), CPU tensors to ref.py;
`GLMFLASH_KERNEL_SPARSE_MLA=ref|triton` forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.sparse_mla.ref import sparse_mla_ref


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
               scale: float) -> torch.Tensor:
    """Absorbed-latent attention over selected slots; see `sparse_mla_ref`."""
    if use_triton(q_lat, "sparse_mla"):
        from glmflash.kernels.sparse_mla import triton_impl

        return triton_impl.sparse_mla(q_lat, latent, slots, scale=scale)
    return sparse_mla_ref(q_lat, latent, slots, scale=scale)


__all__ = ["sparse_mla", "sparse_mla_ref"]
