"""MoE routing (spec/model.md §5.2): sigmoid scores in fp32, bias-corrected and group-limited
top-k choice, weights from the uncorrected scores, renormalised and scaled."""

from __future__ import annotations

from typing import NamedTuple

import torch


class RouterSpec(NamedTuple):
    """The routing constants of a model."""

    top_k: int
    num_groups: int
    topk_groups: int
    renormalize: bool
    scaling: float


def route_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, spec: RouterSpec,
              weight_fp32: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids `[T, k]` int64, fp32 weights `[T, k]`) of x `[T, D]` over the router weight
    `[E, D]` (scored in fp32; `weight_fp32`: its fp32 copy, when the caller keeps one) and the
    correction bias `[E]`. No host sync."""
    return select_ref(scores_ref(x, weight, weight_fp32), bias, spec)


def scores_ref(x: torch.Tensor, weight: torch.Tensor, weight_fp32: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Sigmoid scores `[T, E]` in fp32, the model-dtype weight taken exactly in fp32."""
    w = weight_fp32 if weight_fp32 is not None else weight.float()
    return torch.sigmoid(x.float() @ w.t())


def grouped_choice(scores: torch.Tensor, bias: torch.Tensor, spec: RouterSpec
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The two choices behind the routing of sigmoid scores `[T, E]`: each group's score (its
    best two biased scores summed) `[T, G]`, of which the best `topk_groups` are kept, and the
    biased scores with the other groups' set to -inf `[T, E]`, of which the best `top_k` are
    the experts."""
    choice = scores + bias
    num_tokens = scores.shape[0]
    grouped = choice.view(num_tokens, spec.num_groups, -1)
    group_scores = grouped.topk(2, dim=-1).values.sum(-1)
    kept = group_scores.topk(spec.topk_groups, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(num_tokens, -1)
    return group_scores, choice


def select_ref(scores: torch.Tensor, bias: torch.Tensor, spec: RouterSpec
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The choice and weights from the sigmoid scores `[T, E]`."""
    _, choice = grouped_choice(scores, bias, spec)
    ids = choice.topk(spec.top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if spec.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * spec.scaling
