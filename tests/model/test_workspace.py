"""No buffer of a forward grows with the context: a prefill chunk and a decode at two contexts
(the second three times the first, both past two indexer pool tiles) allocate, op by op, no
larger buffer, and reach the same peak of live buffers. The context is faked (counted as
cached, zeros in the cache): only the sizes matter here."""

from __future__ import annotations

import gc

import pytest

from glmflash.kernels.indexer import ref as indexer_ref
from glmflash.kernels.indexer.ref import SelectTiling
from tests.buffer_tracker import BufferTracker
from tests.conftest import PackedRunner, load_tiny

CHUNK = 64
# Live buffers are counted as their storages die, which reference cycles can delay a little.
PEAK_SLACK = 1.05


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return load_tiny(tiny_dirs["embedded"])


def _workspace(model, context: int) -> dict[str, BufferTracker]:
    """Buffers of a CHUNK-token prefill chunk and of one decode after `context` tokens."""
    runner = PackedRunner(model, 1, max_len=context + CHUNK + 1)
    runner.done[0] = context
    gc.collect()
    with BufferTracker() as prefill:
        runner.forward({0: [(7 * i) % 1000 for i in range(CHUNK)]})
    gc.collect()
    with BufferTracker() as decode:
        runner.decode({0: 5}, max_pools=runner.done[0] // model.config.index_kpool)
    return {"prefill": prefill, "decode": decode}


def _growth(model, short: int, long: int) -> list[str]:
    """What grew between the two contexts, in words (empty when nothing did)."""
    grown = []
    for (kind, a), b in zip(_workspace(model, short).items(),
                            _workspace(model, long).values(), strict=True):
        for op, nbytes in b.largest_by_op.items():
            if nbytes > a.largest_by_op.get(op, 0):
                grown.append(f"{kind}: {op} made a buffer of {nbytes} bytes "
                             f"({a.largest_by_op.get(op, 0)} at the shorter context)")
        if b.peak_bytes > a.peak_bytes * PEAK_SLACK:
            grown.append(f"{kind}: peak of live buffers {a.peak_bytes} -> {b.peak_bytes} bytes")
    return grown


def test_no_buffer_grows_with_context(model):
    tile_tokens = indexer_ref.REF_TILING.pool_tile * model.config.index_kpool
    # Two full pool tiles and a part: the merge of a full tile with the best so far is made.
    short = 2 * tile_tokens + 3616
    assert _growth(model, short, 3 * short) == []


def test_growth_is_detected_without_pool_tiling(model, monkeypatch):
    """The check can fail: scoring every pool in one pass makes the buffers grow."""
    monkeypatch.setattr(indexer_ref, "REF_TILING", SelectTiling(1 << 40, 1 << 30))
    grown = _growth(model, 2000, 6000)
    assert any(g.startswith("prefill: aten.einsum") for g in grown), grown
    assert any(g.startswith("decode: aten.einsum") for g in grown), grown
