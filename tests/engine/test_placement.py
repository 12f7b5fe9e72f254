"""Expert placement helpers that need no GPU: frequency choice, host copy ranges, router counts."""

from __future__ import annotations

import torch

from glmflash.engine.experts import most_routed
from glmflash.engine.layerwise import _runs_without
from glmflash.model.moe import Router
from tests.conftest import PackedRunner, load_tiny


def test_most_routed_picks_the_busiest_experts_per_layer():
    counts = [torch.tensor([3, 9, 1, 9, 0]), torch.tensor([0, 0, 5, 1, 2])]
    assert most_routed(counts, 2) == ((1, 3), (2, 4))
    assert most_routed(counts, 0) == ((), ())


def test_host_copy_ranges_skip_resident_experts():
    assert _runs_without([1, 3], 6) == [(0, 1), (2, 3), (4, 6)]
    assert _runs_without([], 4) == [(0, 4)]
    assert _runs_without([0, 1, 2], 3) == []


def test_router_counts_every_choice(tiny_dirs):
    model = load_tiny(tiny_dirs["embedded"])
    routers = [m for m in model.modules() if isinstance(m, Router)]
    for router in routers:
        router.counts = torch.zeros(router.weight.shape[0], dtype=torch.long)
    PackedRunner(model, 1).forward({0: list(range(10, 31))})
    top_k = model.config.num_experts_per_tok
    assert all(int(r.counts.sum()) == 21 * top_k for r in routers)
