"""RMSNorm: `rms_norm(x, weight, eps)`. CUDA tensors go to the Triton kernel (one launch
instead of eight elementwise ops), CPU tensors to ref.py; `GLMFLASH_KERNEL_RMS_NORM=ref|triton`
forces one."""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.rms_norm.ref import rms_norm_ref


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """See `rms_norm_ref`."""
    if use_triton(x, "rms_norm") and (weight is None or weight.dtype == x.dtype):
        from glmflash.kernels.rms_norm import triton_impl

        return triton_impl.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


__all__ = ["rms_norm", "rms_norm_ref"]
