"""Sparse MLA over the indexer's selection: `sparse_mla(q_lat, latent, slots, scale=...)`.

CUDA tensors go to the Triton kernel (triton_impl.py), or on SM90 where its programs are long
enough (prefill, decodes of 32 queries and more) to the warp-specialised Gluon kernel
(gluon_sm90.py); CPU tensors go to ref.py. `GLMFLASH_KERNEL_SPARSE_MLA=ref|triton` forces the
reference or the GPU kernels.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.sparse_mla.plan import SparseMlaWorkspace, split_plan
from glmflash.kernels.sparse_mla.ref import sparse_mla_ref


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
               scale: float, workspace: SparseMlaWorkspace | None = None) -> torch.Tensor:
    """Absorbed-latent attention over selected slots; see `sparse_mla_ref`. `workspace`
    (from `sparse_mla_workspace`) serves the Triton kernel's split launches."""
    if use_triton(q_lat, "sparse_mla"):
        from glmflash.kernels.sparse_mla import gluon_sm90, triton_impl

        impl = gluon_sm90 if gluon_sm90.serves(q_lat, latent, slots, workspace) else triton_impl
        return impl.sparse_mla(q_lat, latent, slots, scale=scale, workspace=workspace)
    return sparse_mla_ref(q_lat, latent, slots, scale=scale)


def sparse_mla_workspace(q_lat: torch.Tensor, slots: torch.Tensor) -> SparseMlaWorkspace | None:
    """A workspace for every `sparse_mla` launch of these shapes, or None where none splits the
    selection (the reference, or enough queries to fill the GPU unsplit)."""
    if not use_triton(q_lat, "sparse_mla"):
        return None
    from glmflash.kernels.sparse_mla.plan import DEFAULT_CONFIG
    from glmflash.kernels.triton_utils import num_sms

    num_queries, heads, rank = q_lat.shape
    sms, width = num_sms(q_lat.device), slots.shape[1]
    smallest = min(shape.block_slots for shape in DEFAULT_CONFIG.decode)
    if split_plan(num_queries, heads, width, smallest, sms, DEFAULT_CONFIG).num_splits == 1:
        return None
    return SparseMlaWorkspace.create(num_queries, heads, rank, width, q_lat.device, sms,
                                     out_dtype=q_lat.dtype)


__all__ = ["SparseMlaWorkspace", "sparse_mla", "sparse_mla_ref", "sparse_mla_workspace"]
