"""Indexer selection tiled over queries and pools: the same selection as one pass at any tile
size (the top k of a union is the top k of each part's top k), in the reference and in Triton
(interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.indexer import SelectTiling, indexer_select_ref
from glmflash.kernels.indexer.triton_impl import indexer_select
from tests.kernels.test_indexer_triton import _batch

PAGE = 16
# Enough heads that no two pools tie (a pool scores exactly 0 when every head's relu is 0, and
# tied pools at the k-th place may be chosen either way).
HEADS = 16
ONE_PASS = SelectTiling(max_score_elems=1 << 40, pool_tile=1 << 30)
TILINGS = {
    "pools_3": SelectTiling(max_score_elems=1 << 40, pool_tile=3),
    "pools_7_rows_5": SelectTiling(max_score_elems=5 * 7 * 48, pool_tile=7),
}
CASES = {
    "prefill_long": ([40, 1], [150, 97]),
    "decodes": ([1, 1, 1], [3, 130, 61]),
    "chunk_at_pool_edge": ([13, 2], [63, 0]),
}


def _sorted(slots: torch.Tensor) -> torch.Tensor:
    return slots.sort(dim=1).values


@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
@pytest.mark.parametrize("new,prefix", CASES.values(), ids=CASES.keys())
def test_tiled_reference_equals_one_pass(new, prefix, tiling):
    (q, w, pk, table), plan = _batch(new, prefix, HEADS, 32, 4, torch.float32)
    kw = dict(page_size=PAGE, topk=16, kpool=4, select_tail=True)
    want = indexer_select_ref(q, w, pk, table, plan, tiling=ONE_PASS, **kw)
    got = indexer_select_ref(q, w, pk, table, plan, tiling=tiling, **kw)
    # Scores are distinct (random keys), so even the order (best first) is the same.
    assert torch.equal(got, want)


@pytest.mark.parametrize("tiling", TILINGS.values(), ids=TILINGS.keys())
def test_tiled_triton_equals_reference(tiling):
    new, prefix = [20, 1, 1], [90, 97, 30]
    (q, w, pk, table), plan = _batch(new, prefix, HEADS, 32, 4, torch.float32)
    kw = dict(page_size=PAGE, topk=16, kpool=4, select_tail=True)
    want = indexer_select_ref(q, w, pk, table, plan, tiling=ONE_PASS, **kw)
    got = indexer_select(q, w, pk, table, plan, tiling=tiling, **kw)
    assert torch.equal(_sorted(got), _sorted(want))


def test_few_candidates_pad_with_minus_one():
    """Rows with fewer complete pools than k keep -1 for the missing ones across tiles."""
    (q, w, pk, table), plan = _batch([9], [2], HEADS, 32, 4, torch.float32)
    kw = dict(page_size=PAGE, topk=32, kpool=4, select_tail=True)
    tiling = TILINGS["pools_3"]
    want = indexer_select_ref(q, w, pk, table, plan, tiling=ONE_PASS, **kw)
    assert torch.equal(indexer_select_ref(q, w, pk, table, plan, tiling=tiling, **kw), want)
    got = indexer_select(q, w, pk, table, plan, tiling=tiling, **kw)
    assert torch.equal(_sorted(got), _sorted(want)) and (want == -1).any()
