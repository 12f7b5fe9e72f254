"""Prefix cache bookkeeping with fake sequences and a fake runner (no model).

The fake runner stores, per token slot, the token written there and, per state slot and snapshot,
the whole prefix its state summarises; after applying a batch's page updates and cache copies it
checks that every scheduled sequence sees exactly its own prefix (pages and state) before the
"forward" writes the new tokens. Reference counts and the tree are checked after every step.
"""

from __future__ import annotations

import random
from array import array

import pytest

from glmflash.engine.cache import CacheManager, CachePlan
from glmflash.engine.radix_cache import RadixCache
from glmflash.engine.scheduler import Scheduler, SchedulerConfig
from glmflash.engine.sequence import Sequence
from glmflash.sampling_params import SamplingParams


class FakeRunner:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.tokens: dict[int, int] = {}
        self.states: dict[int, tuple[int, ...]] = {}
        self.snapshots: dict[int, tuple[int, ...]] = {}
        self.page_table: dict[tuple[int, int], int] = {}
        self.num_loaded_tokens = 0

    def run(self, batch) -> None:
        for slot, index, page in batch.page_updates:
            self.page_table[slot, index] = page
        ops = batch.cache_ops
        if ops:
            assert len({s for _, s in ops.saves}) == len(ops.saves), "two saves to one snapshot"
            for slot, snap in ops.saves:
                self.snapshots[snap] = self.states[slot]
            for src, dst in ops.page_copies:
                for o in range(self.page_size):
                    self.tokens[dst * self.page_size + o] = self.tokens.get(
                        src * self.page_size + o)
            for snap, slot in ops.loads:
                self.states[slot] = self.snapshots[snap]
                self.num_loaded_tokens += len(self.snapshots[snap])
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            self._check_sees_own_prefix(seq)
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.tokens[self._slot(seq, pos)] = seq.token_ids[pos]
            self.states[seq.state_slot] = tuple(seq.token_ids[:seq.num_computed_tokens + n])

    def _slot(self, seq: Sequence, pos: int) -> int:
        page = self.page_table[seq.state_slot, pos // self.page_size]
        assert page == seq.page_ids[pos // self.page_size], "stale page table"
        return page * self.page_size + pos % self.page_size

    def _check_sees_own_prefix(self, seq: Sequence) -> None:
        done = seq.num_computed_tokens
        if done:
            assert self.states[seq.state_slot] == tuple(seq.token_ids[:done]), "wrong state"
        got = [self.tokens.get(self._slot(seq, p)) for p in range(done)]
        assert got == list(seq.token_ids[:done]), f"sequence {seq.seq_id} reads wrong pages"


# The smallest cache below holds 28 tokens: a prompt plus its outputs always fits alone.
MAX_PROMPT = 20


def _make(num_pages=24, page_size=4, slots=3, budget=9, snapshots=5, max_len=64):
    plan = CachePlan(num_pages, page_size, slots, -(-max_len // page_size), snapshots)
    cache = CacheManager(plan, use_prefix_cache=True)
    sched = Scheduler(SchedulerConfig(slots, budget, max_len), cache, frozenset())
    return sched, cache, FakeRunner(page_size)


def _step(sched, cache, runner, rng) -> list:
    batch = sched.schedule()
    if batch is None:
        return []
    runner.run(batch)
    deltas = sched.update(batch, [rng.randrange(50, 60) for _ in range(sum(batch.needs_sample))])
    cache.check_integrity()
    return deltas


def _prompt(rng: random.Random, stems: list[list[int]]) -> list[int]:
    """A prompt that often shares a prefix of random length with an earlier one."""
    stem = rng.choice(stems)
    prompt = stem[: rng.randrange(0, len(stem) + 1)] + \
        [rng.randrange(1, 6) for _ in range(rng.randrange(1, 14))]
    prompt = prompt[:MAX_PROMPT]
    stems.append(prompt)
    return prompt


@pytest.mark.parametrize("seed", range(8))
def test_random_traffic_keeps_counts_exact_and_prefixes_correct(seed):
    rng = random.Random(seed)
    sched, cache, runner = _make(num_pages=rng.choice((14, 24)), page_size=rng.choice((2, 4)),
                                 snapshots=rng.choice((1, 3, 8)))
    stems: list[list[int]] = [[1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]]
    live: list[Sequence] = []
    for i in range(250):
        if rng.random() < 0.5:
            seq = Sequence(i, _prompt(rng, stems), SamplingParams(max_tokens=rng.randrange(1, 6)))
            sched.add(seq)
            live.append(seq)
        if live and rng.random() < 0.1:
            sched.abort(rng.choice(live).seq_id)
            cache.check_integrity()
        _step(sched, cache, runner, rng)
        live = [s for s in live if not s.is_finished]
    while sched.has_work:
        _step(sched, cache, runner, rng)
    assert runner.num_loaded_tokens > 0
    assert cache.num_free_pages == cache.plan.num_pages
    cache.radix.evict_pages(cache.plan.num_pages)
    assert not cache.radix.nodes and len(cache.pages.free) == cache.plan.num_pages
    cache.check_integrity()


def test_hit_starts_after_the_cached_prompt_and_counts_it():
    sched, cache, runner = _make(page_size=4, budget=32)
    rng = random.Random(0)
    first = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=2))
    sched.add(first)
    while sched.has_work:
        _step(sched, cache, runner, rng)
    # The next turn: the whole previous prompt (10 tokens, mid-page) plus new tokens.
    second = Sequence(1, list(range(1, 11)) + [7, 7, 7], SamplingParams(max_tokens=2))
    sched.add(second)
    batch = sched.schedule()
    assert second.num_cached_tokens == 10 and batch.num_tokens == [3]
    assert batch.cache_ops.loads and batch.cache_ops.page_copies == [
        (first_page_of(cache, 10), second.page_ids[2])]
    runner.run(batch)


def first_page_of(cache: CacheManager, num_tokens: int) -> int:
    """The cached page holding position num_tokens - 1 of the only cached path."""
    node = next(iter(cache.radix.root.children.values()))
    while node.end < num_tokens:
        node = next(iter(node.children.values()))
    return node.pages[-1]


def test_a_prompt_seen_whole_is_recomputed_from_its_last_snapshot_before_the_end():
    sched, cache, runner = _make(page_size=4, budget=6)
    rng = random.Random(0)
    for i in range(2):
        seq = Sequence(i, list(range(1, 15)), SamplingParams(max_tokens=1))
        sched.add(seq)
        while sched.has_work:
            _step(sched, cache, runner, rng)
    # Chunks of 6 end at 6 and 12; the prompt end (14) cannot be used (a token must be left).
    assert seq.num_cached_tokens == 12


class Refs:
    def __init__(self) -> None:
        self.refs: dict[int, int] = {}

    def ref(self, page: int) -> None:
        self.refs[page] = self.refs.get(page, 0) + 1

    def unref(self, page: int) -> None:
        self.refs[page] -= 1


def test_split_keeps_pages_locks_and_snapshot_with_the_right_halves():
    refs = Refs()
    cache = RadixCache(refs, page_size=4, num_snapshots=2)
    key = array("q", range(1, 11))
    node = cache.insert(cache.root, key, 10, [100, 101, 102])
    cache.lock(node)
    assert cache.take_snapshot(node) == 0 and cache.num_evictable_pages == 0
    other = array("q", [1, 2, 3, 4, 5, 6, 9, 9])
    leaf = cache.insert(cache.root, other, 8, [100, 201])
    upper = leaf.parent
    assert (upper.end, upper.pages, upper.lock_ref) == (6, [100, 101], 1)
    assert (node.start, node.first_page, node.pages, node.snapshot) == (6, 2, [102], 0)
    # Positions 6 and 7 share page index 1 with the upper half, but in the new sequence's page.
    assert (leaf.first_page, leaf.pages) == (1, [201])
    assert cache.num_evictable_pages == len(leaf.pages)
    # The match stops at the deepest snapshot: the new leaf has none.
    assert cache.match(other, 8) is None
    hit = cache.match(key, 10)
    assert hit.num_tokens == 10 and hit.pages == [100, 101, 102]


def test_eviction_skips_locked_and_pending_and_takes_tombstones_first():
    refs = Refs()
    cache = RadixCache(refs, page_size=2, num_snapshots=1)
    a = cache.insert(cache.root, array("q", [1, 1, 1, 1]), 4, [10, 11])
    b = cache.insert(cache.root, array("q", [2, 2, 2, 2]), 4, [20, 21])
    assert cache.take_snapshot(a) == 0
    # The only snapshot is pending (its copy has not reached the runner): b gets none.
    assert cache.take_snapshot(b) is None
    cache.clear_pending()
    cache.lock(a)
    assert cache.evict_pages(1) == 2 and b not in cache.nodes  # the tombstone, a is locked
    assert cache.evict_pages(10) == 0
    cache.unlock(a)
    assert cache.evict_pages(10) == 2 and cache.free_snapshots == [0]
    assert all(n == 0 for n in refs.refs.values())


@pytest.mark.parametrize("seed", range(4))
def test_random_insert_match_evict_release(seed):
    """Tree operations in random order, each followed by the full check: structure, locks,
    evictable count, snapshots, reference counts, and that a hit's pages hold its key."""
    from glmflash.engine.radix_cache import check_tree

    rng, size = random.Random(seed), (2, 4)[seed % 2]
    refs = Refs()
    cache = RadixCache(refs, page_size=size, num_snapshots=3)
    content: dict[int, list[int]] = {}  # page -> the keys written in it
    live: list[tuple] = []  # (locked node, pages the sequence holds)
    stems = [[1, 2, 1, 2, 1, 2, 1, 2]]
    for _ in range(300):
        op = rng.choice(("insert", "insert", "match", "evict", "release", "flush"))
        if op == "insert":
            key = _prompt(rng, stems)
            pages = [_fresh_page(content, key, i, size) for i in range(-(-len(key) // size))]
            for page in pages:
                refs.ref(page)
            node = cache.insert(cache.root, array("q", key), len(key), pages)
            cache.lock(node)
            cache.take_snapshot(node)
            live.append((node, pages))
        elif op == "match":
            key = array("q", _prompt(rng, stems))
            hit = cache.match(key, len(key))
            if hit is not None:
                for pos in range(hit.num_tokens):
                    assert content[hit.pages[pos // size]][pos % size] == key[pos]
                cache.lock(hit.node)
                shared = hit.pages[: hit.num_tokens // size]
                for page in shared:
                    refs.ref(page)
                live.append((hit.node, shared))
        elif op == "evict":
            cache.evict_pages(rng.randrange(1, 6))
        elif op == "release" and live:
            node, pages = live.pop(rng.randrange(len(live)))
            cache.unlock(node)
            for page in pages:
                refs.unref(page)
        elif op == "flush":
            cache.clear_pending()
        check_tree(cache, [node for node, _ in live])
        held = cache.page_holders()
        for page, count in refs.refs.items():
            by_seqs = sum(pages.count(page) for _, pages in live)
            assert count == held.get(page, 0) + by_seqs, f"page {page}"
        for node in cache.nodes:
            assert node.lock_ref or all(refs.refs[p] == 1 for p in node.pages)


def _fresh_page(content: dict[int, list[int]], key: list[int], index: int, size: int) -> int:
    page = len(content)
    content[page] = key[index * size: (index + 1) * size]
    return page
