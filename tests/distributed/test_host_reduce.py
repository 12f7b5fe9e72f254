"""The shared-memory all-reduce of CPU ranks on one host: the same sum on every rank, in place,
over many calls (double-buffered slots); tensors larger than a slot left to gloo; a waiting rank
raises on abort and on timeout instead of hanging."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
import torch.distributed as dist

from glmflash.distributed.host_reduce import SLOT_BYTES, HostAllReduce

pytestmark = pytest.mark.skipif(not HostAllReduce.supported(2), reason="needs x86 and /dev/shm")


def _worker(name: str, rank: int, calls: int, out) -> None:
    reduce = HostAllReduce.attach(name, rank, 2, timeout_s=30)
    try:
        results = []
        for i in range(calls):
            x = torch.full((3, 5), float(rank + 1) * (i + 1))
            assert reduce.all_reduce(x)
            results.append(x.clone())
        out.put(torch.stack(results).tolist())
    finally:
        reduce.close()


def test_every_rank_gets_the_sum_over_many_calls():
    owner = HostAllReduce.create(2, timeout_s=30)
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_worker, args=(owner.name, 1, 50, out))
    child.start()
    try:
        mine = []
        for i in range(50):
            x = torch.full((3, 5), 1.0 * (i + 1))
            assert owner.all_reduce(x)
            mine.append(x.clone())
        theirs = torch.tensor(out.get(timeout=60))
    finally:
        child.join(30)
        owner.close()
    want = torch.stack([torch.full((3, 5), 3.0 * (i + 1)) for i in range(50)])
    assert torch.equal(torch.stack(mine), want) and torch.equal(theirs, want)


def test_a_tensor_larger_than_a_slot_is_left_to_gloo():
    owner = HostAllReduce.create(2, timeout_s=1)
    try:
        big = torch.zeros(SLOT_BYTES // 4 + 1)
        assert not owner.all_reduce(big)
        assert owner.sequence == 0
    finally:
        owner.close()


def test_a_waiting_rank_raises_on_abort_and_on_timeout():
    owner = HostAllReduce.create(2, timeout_s=0.5)
    try:
        with pytest.raises(dist.DistError, match="not every rank arrived"):
            owner.all_reduce(torch.ones(4))
        owner.abort()
        with pytest.raises(dist.DistError, match="aborted"):
            owner.all_reduce(torch.ones(4))
    finally:
        owner.close()
