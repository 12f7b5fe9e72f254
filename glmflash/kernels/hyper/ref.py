"""Manifold-constrained hyper-connections (mHC), spec/model.md §2.2. fp32 math.

Shapes: streams `[T, S, D]` (S = hc_mult), fn `[(2+S)*S, S*D]`, base `[(2+S)*S]`, scale `[3]`.
"""

from __future__ import annotations

import torch


def hyper_pre_ref(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                  *, norm_eps: float, hc_eps: float, sinkhorn_iters: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (post, comb, collapsed).

    post `[T, S]` and comb `[T, S, S]` are fp32; collapsed `[T, D]` is in the streams' dtype.
    """
    num_tokens, s, _ = streams.shape
    flat = streams.reshape(num_tokens, -1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixed = flat @ fn.float().t()
    pre_w, post_w, comb_w = mixed.split([s, s, s * s], dim=-1)
    pre_b, post_b, comb_b = base.float().split([s, s, s * s])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.view(num_tokens, s, s) * scale[2] + comb_b.view(s, s)
    comb = sinkhorn(torch.softmax(logits, dim=-1) + hc_eps, hc_eps, sinkhorn_iters)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def sinkhorn(comb: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """Column-normalise once, then `iters - 1` times rows then columns.

    The last step is always a column normalisation.
    """
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hyper_post_ref(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                   comb: torch.Tensor) -> torch.Tensor:
    """`X'[j] = post[j] * y + sum_i comb[i, j] * X[i]`, in the streams' dtype.

    The weights are cast to the streams' dtype first.
    """
    dtype = streams.dtype
    expanded = post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2)
    return expanded + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
