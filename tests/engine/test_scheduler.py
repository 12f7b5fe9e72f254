"""Scheduler and cache bookkeeping with fake sequences and no model."""

from __future__ import annotations

import pytest

from glmflash.engine.cache import CacheManager, CachePlan
from glmflash.engine.scheduler import Scheduler, SchedulerConfig
from glmflash.engine.sequence import Sequence, SequenceStatus
from glmflash.sampling_params import SamplingParams

EOS = 99


def _make(num_pages=16, page_size=4, slots=4, budget=8, max_running=4, max_len=64):
    cache = CacheManager(CachePlan(num_pages, page_size, slots, -(-max_len // page_size)))
    config = SchedulerConfig(max_running, budget, max_len)
    sched = Scheduler(config, cache, frozenset({EOS}))
    sched.page_mirror = {}  # what a runner's device page table holds, from the batches alone
    return sched, cache


def _seq(i: int, n: int, max_tokens: int = 4) -> Sequence:
    return Sequence(i, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def _run_step(sched: Scheduler, token: int = 7):
    batch = sched.schedule()
    if batch is None:
        return None, []
    entries = [(slot, index) for slot, index, _ in batch.page_updates]
    assert len(entries) == len(set(entries)), "an entry of the page table written twice"
    for slot, index, page in batch.page_updates:
        sched.page_mirror[slot, index] = page
    for seq in batch.seqs:
        mirrored = [sched.page_mirror.get((seq.state_slot, i)) for i in range(len(seq.page_ids))]
        assert mirrored == seq.page_ids, f"page table row of sequence {seq.seq_id} is stale"
    deltas = sched.update(batch, [token] * sum(batch.needs_sample))
    sched.cache.check_integrity()
    return batch, deltas


def test_chunked_prefill_under_token_budget():
    sched, _ = _make(budget=5)
    sched.add(_seq(0, 12))
    sizes = []
    while True:
        batch, deltas = _run_step(sched)
        sizes.append(batch.num_tokens[0])
        if deltas:
            break
    assert sizes == [5, 5, 2]  # the last chunk reaches the prompt end and samples


def test_decode_first_then_fifo_admission():
    sched, _ = _make(budget=6, max_running=2)
    for i, n in enumerate((3, 10, 4)):
        sched.add(_seq(i, n))
    batch, _ = _run_step(sched)
    assert [s.seq_id for s in batch.seqs] == [0, 1] and batch.num_tokens == [3, 3]
    batch, _ = _run_step(sched)
    # Seq 0 decodes first (1 token), seq 1 continues its prefill; seq 2 waits (running limit).
    assert batch.num_tokens == [1, 5] and [s.seq_id for s in batch.seqs] == [0, 1]
    assert [s.seq_id for s in sched.waiting] == [2]


def test_preemption_when_pages_run_out_and_recompute():
    sched, cache = _make(num_pages=6, page_size=4, budget=64, max_running=3)
    seqs = [_seq(i, 7, max_tokens=8) for i in range(3)]
    for s in seqs:
        sched.add(s)
    while sched.has_work:
        _run_step(sched)
    assert sched.num_preemptions > 0
    assert all(s.num_output_tokens == 8 and s.finish_reason == "length" for s in seqs)
    assert cache.num_free_pages == 6 and not cache.owners


def test_eos_and_stop_token_finish_and_free():
    sched, cache = _make()
    a, b = _seq(0, 3), Sequence(1, [1, 2], SamplingParams(max_tokens=9, stop_token_ids=[5]))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    deltas = sched.update(batch, [EOS, 5])
    assert [d.finish_reason for d in deltas] == ["stop", "stop"]
    assert a.is_finished and b.is_finished and not sched.has_work
    assert cache.num_free_pages == cache.plan.num_pages


def test_ignore_eos_runs_to_length():
    sched, _ = _make()
    seq = Sequence(0, [1], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add(seq)
    while sched.has_work:
        _run_step(sched, token=EOS)
    assert seq.finish_reason == "length" and seq.output_token_ids == [EOS] * 3


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_everything(when):
    sched, cache = _make(budget=4)
    seq = _seq(0, 10, max_tokens=5)
    sched.add(seq)
    steps = {"waiting": 0, "mid_prefill": 1, "mid_decode": 4}[when]
    for _ in range(steps):
        _run_step(sched)
    assert sched.abort(0) is seq
    assert seq.finish_reason == "abort" and seq.status == SequenceStatus.FINISHED
    assert not sched.has_work and cache.num_free_pages == cache.plan.num_pages
    cache.check_integrity()
    assert sched.abort(0) is None


def test_max_running_requests_is_respected():
    sched, _ = _make(max_running=2, budget=100)
    for i in range(5):
        sched.add(_seq(i, 3))
    batch, _ = _run_step(sched)
    assert len(batch.seqs) == 2 and len(sched.waiting) == 3


def test_integrity_check_catches_a_leak():
    _, cache = _make()
    seq = _seq(0, 5)
    cache.allocate(seq, 5)
    seq.page_ids.pop()
    with pytest.raises(AssertionError):
        cache.check_integrity()


def test_a_slot_handed_out_twice_in_a_step_updates_its_row_once():
    """A sequence freed (preempted) and its state slot given to another in the same step: one
    page-table write per entry, the newest page's."""
    _, cache = _make(num_pages=8, page_size=4, slots=1)
    first, second = _seq(0, 8), _seq(1, 8)
    cache.allocate(first, 8)
    cache.free(first)
    cache.allocate(second, 8)
    updates = cache.take_page_updates()
    assert sorted((slot, index) for slot, index, _ in updates) == [(0, 0), (0, 1)]
    assert [page for _, _, page in sorted(updates)] == second.page_ids
