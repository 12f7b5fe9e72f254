"""RMSNorm: `rms_norm(x, weight, eps)`. CUDA tensors go to the Triton kernel (one launch
instead of eight elementwise ops), CPU tensors to ref.py; `GLMFLASH_KERNEL_RMS_NORM=ref|triton`
forces one."""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.rms_norm.ref import rms_norm_pair_ref, rms_norm_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """See `rms_norm_ref`."""
    if use_triton(x, "rms_norm") and (weight is None or weight.dtype == x.dtype):
        from glmflash.kernels.rms_norm import triton_impl

        return triton_impl.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_pair(x: torch.Tensor, weight_a: torch.Tensor, eps_a: float,
                  weight_b: torch.Tensor, eps_b: float, out_b: torch.Tensor,
                  rows_b: torch.Tensor) -> torch.Tensor:
    """Two RMSNorms over the halves of one product's rows (MLA's query and key-value down
    projections): the first half's is returned, the second's written into rows `rows_b` of
    `out_b` (the latent cache). See `rms_norm_pair_ref`; one launch on CUDA."""
    if use_triton(x, "rms_norm") and x.dtype == weight_a.dtype == weight_b.dtype == out_b.dtype:
        from glmflash.kernels.rms_norm import triton_impl

        return triton_impl.rms_norm_pair(x, weight_a, eps_a, weight_b, eps_b, out_b, rows_b)
    return rms_norm_pair_ref(x, weight_a, eps_a, weight_b, eps_b, out_b, rows_b)


__all__ = ["rms_norm", "rms_norm_pair", "rms_norm_pair_ref", "rms_norm_ref"]
