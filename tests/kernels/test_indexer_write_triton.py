"""Triton `indexer_write_decode` (one launch) against ref.indexer_write_decode: the pooled keys
and tails it writes; `indexer_write_verify` (a verify's rows, each sequence's in order, in one
launch) bit for bit against a decode launch per row. Interpreter on the CPU, compiled with
CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.indexer.ref import indexer_write_decode as write_ref
from glmflash.kernels.indexer.write_triton import indexer_write_decode, indexer_write_verify

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _page(kpool):
    return 4 * kpool  # a multiple of kpool, as the cache's page size is


def _case(positions, dim, kpool, dtype, *, seed=0):
    """Sequence b in state slot / page-table row b + 1 (row 0 unused), pages scrambled."""
    gen = torch.Generator().manual_seed(seed)
    num, rows, page = len(positions), len(positions) + 1, _page(kpool)
    pages = max(positions) // page + 1
    table = torch.randperm(rows * pages, generator=gen).view(rows, pages).to(torch.int32)
    keys = torch.randn(num, dim, generator=gen).to(dtype)
    gates = (2 * torch.randn(num, dim, generator=gen)).to(dtype)
    ape = torch.randn(kpool, dim, generator=gen).to(dtype)
    pool_keys = torch.randn(rows * pages * page // kpool, dim, generator=gen).to(dtype)
    tail = torch.randn(rows, kpool - 1, 2 * dim, generator=gen).to(dtype)
    # Slots and positions as columns of one tensor (strided views).
    slots, pos = torch.stack([torch.arange(1, rows), torch.tensor(positions)], 1).unbind(1)
    return [t.to(DEVICE) for t in (keys, gates, ape, pool_keys, tail, table, slots, pos)]


def _run(fn, tensors):
    keys, gates, ape, pool_keys, tail, table, slots, pos = (t.clone() for t in tensors)
    fn(keys, gates, ape, pool_keys, tail, table, slots, pos, page_size=_page(ape.shape[0]))
    return pool_keys, tail


def _check(positions, *, dim=32, kpool=4, dtype=torch.float32):
    tensors = _case(positions, dim, kpool, dtype)
    want_pools, want_tail = _run(write_ref, tensors)
    got_pools, got_tail = _run(indexer_write_decode, tensors)
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


def test_pools_of_one_token():
    """kpool 1: every token is its own pool (no tail), in the reference and the kernel."""
    assert _check([0, 1, 2, 5, 9], kpool=1) == 5


def _verify_case(dtype=torch.float32, dim=32, kpool=4):
    """Three sequences of a verify: rows 0-3 in slot 1 at positions 5..8 (completing the pool
    4..7 at its third row), row 4 alone in slot 2 at position 3 (completing 0..3), rows 5-7 in
    slot 3 at positions 9, 10, then a padding row in the reserved slot 4 at position 0."""
    tensors = _case([0] * 8, dim, kpool, dtype, seed=5)
    keys, gates, ape, pool_keys, _, table, _, _ = tensors
    gen = torch.Generator().manual_seed(6)
    tail = torch.randn(5, kpool - 1, 2 * dim, generator=gen).to(dtype).to(DEVICE)
    table = torch.randperm(5 * table.shape[1], generator=gen).view(5, -1).to(torch.int32)
    slots = torch.tensor([1, 1, 1, 1, 2, 3, 3, 4], device=DEVICE)
    positions = torch.tensor([5, 6, 7, 8, 3, 9, 10, 0], device=DEVICE)
    seqs = torch.tensor([[0, 4, 0], [4, 1, 1], [5, 3, 2]], dtype=torch.int32, device=DEVICE)
    return keys, gates, ape, pool_keys, tail, table.to(DEVICE), slots, positions, seqs


@pytest.mark.parametrize("keep", [True, False], ids=["scratch", "no_scratch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_verify_equals_decode_per_row_bit_for_bit(keep, dtype):
    keys, gates, ape, pool_keys, tail, table, slots, positions, seqs = _verify_case(dtype)
    num_steps, page = 3, _page(ape.shape[0])
    saved = torch.full((3 * num_steps, *tail.shape[1:]), float("nan"), dtype=dtype,
                       device=DEVICE) if keep else None
    want_pools, want_tail = pool_keys.clone(), tail.clone()
    want_saved = None if saved is None else saved.clone()
    for first, count, scratch_row in seqs.tolist():
        for j in range(count):
            row = slice(first + j, first + j + 1)
            indexer_write_decode(keys[row], gates[row], ape, want_pools, want_tail, table,
                                 slots[row], positions[row], page_size=page)
            if keep and j < count - 1:
                want_saved[scratch_row * num_steps + j] = want_tail[int(slots[first + j])]
    indexer_write_verify(keys, gates, ape, pool_keys, tail, table, slots, positions, seqs,
                         saved, num_steps, page_size=page)
    assert torch.equal(tail, want_tail) and torch.equal(pool_keys, want_pools)
    assert (want_pools != _verify_case(dtype)[3]).any(dim=1).sum().item() == 2
    if keep:
        assert torch.equal(saved.float().nan_to_num(7.0), want_saved.float().nan_to_num(7.0))
        assert saved[[3, 4, 5, 8]].isnan().all() and not saved[[0, 1, 2, 6, 7]].isnan().any()


def test_verify_with_pools_of_one_token():
    """kpool 1 under the verify launch: each row writes its own pool, as the reference."""
    keys, gates, ape, _, _, _, slots, positions, seqs = _verify_case(kpool=1)
    gen = torch.Generator().manual_seed(7)
    table = torch.randperm(5 * 3, generator=gen).view(5, 3).to(torch.int32).to(DEVICE)
    pool_keys = torch.randn(5 * 3 * _page(1), keys.shape[1], generator=gen).to(DEVICE)
    tail = torch.zeros(5, 0, 2 * keys.shape[1], device=DEVICE)
    want = pool_keys.clone()
    for row in range(8):
        write_ref(keys[row:row + 1], gates[row:row + 1], ape, want, tail.clone(), table,
                  slots[row:row + 1], positions[row:row + 1], page_size=_page(1))
    before = pool_keys.clone()
    indexer_write_verify(keys, gates, ape, pool_keys, tail, table, slots, positions, seqs,
                         None, 3, page_size=_page(1))
    torch.testing.assert_close(pool_keys, want, atol=1e-5, rtol=1e-5)
    assert (pool_keys != before).any(dim=1).sum().item() == 8


def test_verify_reference_dispatch_agrees():
    from glmflash.kernels.indexer import indexer_write_verify as dispatched

    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    keys, gates, ape, pool_keys, tail, table, slots, positions, seqs = _verify_case()
    saved = torch.zeros(9, *tail.shape[1:])
    ref = [t.clone() for t in (pool_keys, tail, saved)]
    indexer_write_verify(keys, gates, ape, pool_keys, tail, table, slots, positions, seqs, saved,
                         3, page_size=_page(4))
    dispatched(keys, gates, ape, *ref[:2], table, slots, positions, seqs, ref[2], 3,
               page_size=_page(4))
    assert torch.equal(tail, ref[1]) and torch.equal(saved, ref[2])
    torch.testing.assert_close(pool_keys, ref[0], atol=1e-5, rtol=1e-5)


def test_no_tokens():
    tensors = _case([3], 32, 4, torch.float32)
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
