"""Cache bookkeeping (no torch): pages of token slots for MLA latents and pooled indexer keys,
fixed-size state slots for KDA state and the indexer tail, and the prefix cache over both.

A page holds `page_size` consecutive token slots (a multiple of kpool, so a k-pool never straddles
pages and its pooled key lives at `token_slot // kpool`). A sequence holds the pages covering its
computed tokens, in order, and exactly one state slot while it runs. Pages are reference counted:
the prefix cache (radix_cache.py) holds the pages of cached prefixes, and a sequence that starts
from a cached prefix shares them (its partial last page is copied, since it writes the rest).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from glmflash.engine.radix_cache import Node, PrefixHit, RadixCache, check_tree
from glmflash.engine.sequence import Sequence


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    page_size: int
    num_state_slots: int
    max_pages_per_seq: int
    """Pages of the longest sequence (the width of the runner's page table)."""
    num_snapshots: int = 0
    """State snapshots of the prefix cache (0: no prefix cache)."""
    fp8_index_keys: bool = False
    """Pooled indexer keys as FP8 rows (`--index-key-dtype fp8`)."""
    fp8_index_queries: bool = False
    """The indexer scores e4m3 queries against those FP8 keys (`--index-query-dtype fp8`)."""

    @property
    def num_token_slots(self) -> int:
        return self.num_pages * self.page_size


@dataclass(slots=True)
class CacheOps:
    """Copies the runner makes before the next forward, in this order (saves were logged by the
    previous step's update, the others by this step's admissions)."""

    saves: list[tuple[int, int]] = field(default_factory=list)
    """(state slot, snapshot): keep a sequence's state at the end of its last chunk."""
    page_copies: list[tuple[int, int]] = field(default_factory=list)
    """(source page, new page): the partial last page of a cached prefix, for its new reader."""
    loads: list[tuple[int, int]] = field(default_factory=list)
    """(snapshot, state slot): a sequence starts from a cached prefix."""

    def __bool__(self) -> bool:
        return bool(self.saves or self.page_copies or self.loads)


@dataclass(frozen=True, slots=True)
class PrefixCacheStats:
    num_query_tokens: int
    """Prompt tokens of admitted requests (first admission only)."""
    num_hit_tokens: int
    """Of those, tokens taken from the cache."""
    num_cached_pages: int
    num_snapshots: int
    max_snapshots: int


class PagePool:
    def __init__(self, num_pages: int) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.refs = [0] * num_pages

    def take(self) -> int:
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def ref(self, page: int) -> None:
        assert self.refs[page] > 0, f"page {page} is free"
        self.refs[page] += 1

    def unref(self, page: int) -> None:
        self.refs[page] -= 1
        assert self.refs[page] >= 0, f"page {page} released twice"
        if not self.refs[page]:
            self.free.append(page)


class CacheManager:
    def __init__(self, plan: CachePlan, use_prefix_cache: bool = False) -> None:
        self.plan = plan
        self.page_size = plan.page_size
        self.pages = PagePool(plan.num_pages)
        self.free_state_slots = list(range(plan.num_state_slots - 1, -1, -1))
        self.owners: dict[int, Sequence] = {}
        self.page_updates: list[tuple[int, int, int]] = []
        """(state slot, page index, page id) of every page handed out since the last
        `take_page_updates()`: the runner mirrors them into its device page table."""
        self.ops = CacheOps()
        self.radix = RadixCache(self.pages, plan.page_size, plan.num_snapshots) \
            if use_prefix_cache and plan.num_snapshots else None

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out: free ones plus those only the prefix cache holds."""
        evictable = self.radix.num_evictable_pages if self.radix else 0
        return len(self.pages.free) + evictable

    def pages_needed(self, seq: Sequence, num_new_tokens: int,
                     hit: PrefixHit | None = None) -> int:
        """Extra pages for `seq` to hold `num_new_tokens` more computed tokens (after `hit`)."""
        if hit is not None:
            return -(-(hit.num_tokens + num_new_tokens) // self.page_size) - \
                hit.num_tokens // self.page_size
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.page_ids))

    # Prefix hits: match (which locks the prefix), then allocate or release the match.
    def match(self, seq: Sequence) -> PrefixHit | None:
        """The longest cached prefix `seq` can start from (at least one token is left to
        compute, for the logits); locked until `allocate` or `release_match`. A sequence that
        asks for prompt log-probabilities computes its whole prompt (they are not cached)."""
        if self.radix is None or seq.params.prompt_logprobs is not None or \
                seq.skips_prefix_cache:
            return None
        limit = min(seq.num_tokens - 1, seq.num_prompt_tokens)
        hit = self.radix.match(seq.cache_key, limit)
        if hit is not None:
            self.radix.lock(hit.node)
        return hit

    def release_match(self, hit: PrefixHit | None) -> None:
        if hit is not None:
            self.radix.unlock(hit.node)

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     hit: PrefixHit | None = None) -> bool:
        """Room to admit a waiting sequence with its first chunk."""
        return bool(self.free_state_slots) and \
            self.pages_needed(seq, num_new_tokens, hit) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> None:
        assert seq.state_slot is None and not seq.page_ids
        seq.state_slot = self.free_state_slots.pop()
        self.owners[seq.seq_id] = seq
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = hit.num_tokens if hit else 0
        if hit is not None:
            self._start_from(seq, hit)
        self.append(seq, num_new_tokens)

    def _start_from(self, seq: Sequence, hit: PrefixHit) -> None:
        """Share the hit's full pages, copy its partial last page, load its snapshot."""
        num_full = hit.num_tokens // self.page_size
        for index, page in enumerate(hit.pages[:num_full]):
            self.pages.ref(page)
            self._give(seq, index, page)
        if hit.num_tokens % self.page_size:
            self._make_room(1)
            page = self.pages.take()
            self.ops.page_copies.append((hit.pages[num_full], page))
            self._give(seq, num_full, page)
        self.ops.loads.append((hit.snapshot, seq.state_slot))
        self.radix.pending_snapshots.add(hit.snapshot)
        seq.num_computed_tokens = hit.num_tokens
        seq.cache_node = hit.node

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self.pages_needed(seq, num_new_tokens)
        self._make_room(needed)
        for _ in range(needed):
            self._give(seq, len(seq.page_ids), self.pages.take())

    def truncate(self, seq: Sequence) -> None:
        """Give back the pages past a sequence's computed tokens (those of a verify step's
        rejected drafts; they are its own, never a cached prefix's)."""
        keep = -(-seq.num_computed_tokens // self.page_size)
        while len(seq.page_ids) > keep:
            self.pages.unref(seq.page_ids.pop())

    def _give(self, seq: Sequence, index: int, page: int) -> None:
        self.page_updates.append((seq.state_slot, index, page))
        seq.page_ids.append(page)

    def _make_room(self, num_pages: int) -> None:
        short = num_pages - len(self.pages.free)
        if short > 0 and self.radix is not None:
            self.radix.evict_pages(short)
        assert len(self.pages.free) >= num_pages, "out of pages"

    def take_page_updates(self) -> list[tuple[int, int, int]]:
        """The page-table entries handed out since the last call, one per (state slot, page
        index): the latest, where a slot freed and handed out again in one step got the same
        index twice (a device's indexed write of both would keep either)."""
        latest = {(slot, index): page for slot, index, page in self.page_updates}
        self.page_updates = []
        return [(slot, index, page) for (slot, index), page in latest.items()]

    def take_ops(self) -> CacheOps | None:
        """The copies logged since the last call, for the runner (None if there are none)."""
        ops, self.ops = self.ops, CacheOps()
        if self.radix is not None:
            self.radix.clear_pending()
        return ops or None

    def forget_unsaved(self, ops: CacheOps | None) -> None:
        """After a failed step: the snapshots its copies were to save may hold anything, so
        no prefix may start from them."""
        if self.radix is not None and ops is not None and ops.saves:
            self.radix.forget_snapshots({snapshot for _, snapshot in ops.saves})

    def cache_prefix(self, seq: Sequence) -> None:
        """After a prompt chunk: make the computed prefix a cached prefix, with a snapshot of
        the state at its end (always at the prompt's end, the next turn's prefix; at a chunk end
        when at least a page past the path's previous snapshot)."""
        if self.radix is None or seq.state_slot is None or seq.skips_prefix_cache:
            return
        end = seq.num_computed_tokens
        below = seq.cache_node or self.radix.root
        if end <= below.end:
            return
        node = self.radix.insert(below, seq.cache_key, end, seq.page_ids)
        self.radix.lock(node)
        if seq.cache_node is not None:
            self.radix.unlock(seq.cache_node)
        seq.cache_node = node
        if end == seq.num_prompt_tokens or end - _snapshot_end(node.parent) >= self.page_size:
            snapshot = self.radix.take_snapshot(node)
            if snapshot is not None:
                self.ops.saves.append((seq.state_slot, snapshot))

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            return
        for page in reversed(seq.page_ids):
            self.pages.unref(page)
        self.free_state_slots.append(seq.state_slot)
        seq.page_ids = []
        seq.state_slot = None
        if seq.cache_node is not None:
            self.radix.unlock(seq.cache_node)
            seq.cache_node = None
        del self.owners[seq.seq_id]

    def stats(self, num_query_tokens: int, num_hit_tokens: int) -> PrefixCacheStats:
        radix = self.radix
        return PrefixCacheStats(num_query_tokens, num_hit_tokens,
                                radix.num_cached_pages if radix else 0,
                                len(radix.snapshot_lru) if radix else 0,
                                self.plan.num_snapshots if radix else 0)

    def check_integrity(self) -> None:
        """Every page's reference count is the number of live sequences and cached-prefix nodes
        holding it (free iff zero); every state slot is free or owned by one live sequence."""
        held = self.radix.page_holders() if self.radix else {}
        refs = dict(held)
        for seq in self.owners.values():
            for page in seq.page_ids:
                refs[page] = refs.get(page, 0) + 1
        assert all(n == 1 for n in held.values()), "a page is held by two cache nodes"
        for page in range(self.plan.num_pages):
            assert self.pages.refs[page] == refs.get(page, 0), f"page {page}: reference count"
        assert sorted(self.pages.free) == [p for p in range(self.plan.num_pages) if not
                                           refs.get(p)], "free list differs from zero counts"
        slots = [s.state_slot for s in self.owners.values()] + self.free_state_slots
        assert sorted(slots) == list(range(self.plan.num_state_slots)), "state slot leaked"
        for seq in self.owners.values():
            assert len(seq.page_ids) * self.page_size >= seq.num_computed_tokens, \
                f"sequence {seq.seq_id} has fewer pages than computed tokens"
        if self.radix is not None:
            locked = [s.cache_node for s in self.owners.values() if s.cache_node is not None]
            check_tree(self.radix, locked)
            for node in self.radix.nodes:
                assert node.lock_ref or all(self.pages.refs[p] == 1 for p in node.pages), \
                    "an unlocked cache node shares a page with a sequence"


def _snapshot_end(node: Node | None) -> int:
    """End of the deepest node with a snapshot at or above `node` (0: none)."""
    while node is not None and node.snapshot is None:
        node = node.parent
    return node.end if node is not None else 0
