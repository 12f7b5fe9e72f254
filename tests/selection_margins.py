"""How close a run comes to a tie in its discrete choices: the indexer's pool top-k and the
router's group and expert top-k, as the relative gap between the last score chosen and the first
left out.

A random tiny model fed repetitive text scores equal-content pools equally, so the reference
selects between scores that differ by fp32 rounding alone (relative gaps of 1e-7, measured); any
other summation order may pick the other pool and every later token differs. Oracle token tests
on another implementation therefore use prompts whose gaps are far above rounding, checked with
`smallest_selection_gap` on the CPU reference path (which makes the same choices as the oracle).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import glmflash.kernels.indexer.ref as indexer_ref
import glmflash.kernels.router.ref as router_ref


def _gap(scores: torch.Tensor, k: int) -> float:
    """Smallest relative gap between the k-th and (k+1)-th score of a row (inf when a row has
    at most k real candidates: scores at -inf or the dtype's minimum are not)."""
    if scores.shape[1] <= k:
        return float("inf")
    top = scores.sort(dim=1, descending=True).values
    real = top[:, k] > torch.finfo(top.dtype).min
    gap = (top[:, k - 1] - top[:, k]) / top[:, 0].abs().clamp_min(1e-30)
    return float(torch.where(real, gap, torch.inf).min()) if gap.numel() else float("inf")


@contextlib.contextmanager
def recorded_gaps() -> Iterator[list[float]]:
    """Within the block, every reference indexer merge and router choice appends its smallest
    relative gap to the yielded list."""
    gaps: list[float] = []
    merge_best, select_ref = indexer_ref.merge_best, router_ref.select_ref

    def merge(best_scores, best_pools, scores, pools, k):
        gaps.append(_gap(torch.cat([best_scores, scores], dim=1), k))
        return merge_best(best_scores, best_pools, scores, pools, k)

    def select(scores, bias, spec):
        group_scores, choice = router_ref.grouped_choice(scores, bias, spec)
        gaps.extend((_gap(group_scores, spec.topk_groups), _gap(choice, spec.top_k)))
        return select_ref(scores, bias, spec)

    indexer_ref.merge_best, router_ref.select_ref = merge, select
    try:
        yield gaps
    finally:
        indexer_ref.merge_best, router_ref.select_ref = merge_best, select_ref


def smallest_selection_gap(engine, prompt: str, params) -> float:
    """The smallest relative gap of `prompt`'s generation alone on `engine` (a CPU engine, so
    that the reference kernels run)."""
    with recorded_gaps() as gaps:
        list(engine.generate([prompt], params))
    return min(gaps, default=float("inf"))
