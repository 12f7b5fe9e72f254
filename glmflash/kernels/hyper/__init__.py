"""mHC stream collapse (pre) and expand-and-mix (post).

CUDA tensors go to the Triton kernels (triton_impl.py), CPU tensors to ref.py;
`GLMFLASH_KERNEL_HYPER=ref|triton` forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.fused_moe.expert_rows import ExpertRows
from glmflash.kernels.hyper.ref import hyper_post_ref, hyper_pre_ref
from glmflash.kernels.rms_norm import rms_norm


def hyper_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
              *, norm_eps: float, hc_eps: float, sinkhorn_iters: int,
              norm: tuple[torch.Tensor, float] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post, comb, collapsed) of the streams `[T, S, D]`; see `hyper_pre_ref`. With `norm` =
    (weight, eps) the collapsed rows come out as `rms_norm(collapsed, weight, eps)` (the Triton
    kernel normalises them in the same launch)."""
    if use_triton(streams, "hyper") and (norm is None or norm[0].dtype == streams.dtype):
        from glmflash.kernels.hyper import triton_impl

        return triton_impl.hyper_pre(streams, fn, base, scale, norm_eps=norm_eps, hc_eps=hc_eps,
                                     sinkhorn_iters=sinkhorn_iters, norm=norm)
    post, comb, collapsed = hyper_pre_ref(streams, fn, base, scale, norm_eps=norm_eps,
                                          hc_eps=hc_eps, sinkhorn_iters=sinkhorn_iters)
    return post, comb, collapsed if norm is None else rms_norm(collapsed, *norm)


def hyper_post(block_out: torch.Tensor | ExpertRows, streams: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor, *, extra: torch.Tensor | None = None) -> torch.Tensor:
    """New streams `[T, S, D]` from the block output and the pre weights; see `hyper_post_ref`.
    `extra`: a second block output, added to the first (the Triton kernel adds it in the same
    launch). `block_out` may be routed experts' rows before their sum (`ExpertRows`, from the
    Triton fused MoE), which the Triton kernel sums as it reads them."""
    if use_triton(streams, "hyper"):
        from glmflash.kernels.hyper import triton_impl

        return triton_impl.hyper_post(block_out, streams, post, comb, extra=extra)
    if isinstance(block_out, ExpertRows):
        block_out = block_out.summed()
    return hyper_post_ref(block_out if extra is None else block_out + extra, streams, post, comb)


__all__ = ["hyper_post", "hyper_post_ref", "hyper_pre", "hyper_pre_ref"]
