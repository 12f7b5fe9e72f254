"""Triton `indexer_write_decode` (one launch) against ref.indexer_write_decode: the pooled keys
and tails it writes. Interpreter on the CPU, compiled with CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.indexer.ref import indexer_write_decode as write_ref
from glmflash.kernels.indexer.write_triton import indexer_write_decode

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _page(kpool):
    return 4 * kpool  # a multiple of kpool, as the cache's page size is


def _case(positions, dim, kpool, dtype, *, token_rows=None, extra_rows=0, seed=0):
    """Sequence b in state slot / page-table row b + 1 (row 0 unused), pages scrambled; keys
    and gates have `extra_rows` more rows than tokens when `token_rows` picks them."""
    gen = torch.Generator().manual_seed(seed)
    num, rows, page = len(positions), len(positions) + 1, _page(kpool)
    pages = max(positions) // page + 1
    table = torch.randperm(rows * pages, generator=gen).view(rows, pages).to(torch.int32)
    total = num + extra_rows
    keys = torch.randn(total, dim, generator=gen).to(dtype)
    gates = (2 * torch.randn(total, dim, generator=gen)).to(dtype)
    ape = torch.randn(kpool, dim, generator=gen).to(dtype)
    pool_keys = torch.randn(rows * pages * page // kpool, dim, generator=gen).to(dtype)
    tail = torch.randn(rows, kpool - 1, 2 * dim, generator=gen).to(dtype)
    # Slots and positions as columns of one tensor (strided views).
    slots, pos = torch.stack([torch.arange(1, rows), torch.tensor(positions)], 1).unbind(1)
    tensors = [t.to(DEVICE) for t in (keys, gates, ape, pool_keys, tail, table, slots, pos)]
    picks = None if token_rows is None else torch.tensor(token_rows, dtype=torch.int64).to(DEVICE)
    return tensors, picks


def _run(fn, tensors, picks):
    keys, gates, ape, pool_keys, tail, table, slots, pos = (t.clone() for t in tensors)
    fn(keys, gates, ape, pool_keys, tail, table, slots, pos, page_size=_page(ape.shape[0]),
       token_rows=picks)
    return pool_keys, tail


def _check(positions, *, dim=32, kpool=4, dtype=torch.float32, token_rows=None, extra_rows=0):
    tensors, picks = _case(positions, dim, kpool, dtype, token_rows=token_rows,
                           extra_rows=extra_rows)
    want_pools, want_tail = _run(write_ref, tensors, picks)
    got_pools, got_tail = _run(indexer_write_decode, tensors, picks)
    # Tails are copies: equal. Pooled keys: fp32 softmax and sums in another order (fp32);
    # in bf16 also one rounding either side of a boundary (the interpreter truncates).
    assert torch.equal(got_tail, want_tail)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_pools, want_pools, **tol)
    changed = (want_pools != tensors[3]).any(dim=1).sum().item()
    return changed


@pytest.mark.parametrize("dim", [32, 20, 1])
def test_every_pool_offset(dim):
    # Offsets 0..3 of kpool 4, pools completed at 3 and 63, a position past the first page.
    changed = _check([0, 1, 2, 3, 62, 63, 17, 40], dim=dim)
    assert changed == 2  # the two completing tokens wrote their pools, nothing else


def test_kpool_not_a_power_of_two_and_bf16():
    assert _check([2, 5, 11, 1, 8], kpool=3, dtype=torch.bfloat16) == 4


def test_token_rows_pick_the_forward_rows():
    # Three sequences' tokens at rows 4, 0 and 2 of a five-row forward.
    assert _check([3, 6, 7], token_rows=[4, 0, 2], extra_rows=2) == 2


def test_no_tokens():
    tensors, _ = _case([3], 32, 4, torch.float32)
    keys, gates, ape, pool_keys, tail, table, slots, pos = tensors
    empty = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    before = pool_keys.clone(), tail.clone()
    indexer_write_decode(keys[:0], gates[:0], ape, pool_keys, tail, table, empty, empty,
                         page_size=_page(4))
    assert torch.equal(pool_keys, before[0]) and torch.equal(tail, before[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_shape_bf16():
    positions = [int(p) for p in torch.randint(0, 4096, (64,), generator=torch.Generator()
                                               .manual_seed(3))]
    _check(positions, dim=128, kpool=4, dtype=torch.bfloat16)
