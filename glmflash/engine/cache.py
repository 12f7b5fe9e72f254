"""Cache bookkeeping (no torch): pages of token slots for MLA latents and pooled indexer keys,
and fixed-size state slots for KDA state and the indexer tail.

A page holds `page_size` consecutive token slots (a multiple of kpool, so a k-pool never straddles
pages and its pooled key lives at `token_slot // kpool`). A sequence owns the pages covering its
computed tokens, in order, and exactly one state slot while it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from glmflash.engine.sequence import Sequence


@dataclass(frozen=True)
class CachePlan:
    num_pages: int
    page_size: int
    num_state_slots: int
    max_pages_per_seq: int
    """Pages of the longest sequence (the width of the runner's page table)."""

    @property
    def num_token_slots(self) -> int:
        return self.num_pages * self.page_size


class CacheManager:
    def __init__(self, plan: CachePlan) -> None:
        self.plan = plan
        self.page_size = plan.page_size
        self.free_pages = list(range(plan.num_pages - 1, -1, -1))
        self.free_state_slots = list(range(plan.num_state_slots - 1, -1, -1))
        self.owners: dict[int, Sequence] = {}
        self.page_updates: list[tuple[int, int, int]] = []
        """(state slot, page index, page id) of every page handed out since the last
        `take_page_updates()`: the runner mirrors them into its device page table."""

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra pages for `seq` to hold `num_new_tokens` more computed tokens."""
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.page_size) - len(seq.page_ids))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room to admit a waiting sequence with its first chunk."""
        return bool(self.free_state_slots) and \
            self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        assert seq.state_slot is None and not seq.page_ids
        seq.state_slot = self.free_state_slots.pop()
        self.owners[seq.seq_id] = seq
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.pages_needed(seq, num_new_tokens) <= self.num_free_pages

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        for _ in range(self.pages_needed(seq, num_new_tokens)):
            page = self.free_pages.pop()
            self.page_updates.append((seq.state_slot, len(seq.page_ids), page))
            seq.page_ids.append(page)

    def take_page_updates(self) -> list[tuple[int, int, int]]:
        updates, self.page_updates = self.page_updates, []
        return updates

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is None:
            return
        self.free_pages.extend(reversed(seq.page_ids))
        self.free_state_slots.append(seq.state_slot)
        seq.page_ids = []
        seq.state_slot = None
        del self.owners[seq.seq_id]

    def check_integrity(self) -> None:
        """Every page and state slot is either free or owned by exactly one live sequence."""
        owned_pages = [p for s in self.owners.values() for p in s.page_ids]
        pages = owned_pages + self.free_pages
        assert sorted(pages) == list(range(self.plan.num_pages)), "page leaked or shared"
        slots = [s.state_slot for s in self.owners.values()] + self.free_state_slots
        assert sorted(slots) == list(range(self.plan.num_state_slots)), "state slot leaked"
        for seq in self.owners.values():
            assert len(seq.page_ids) * self.page_size >= seq.num_computed_tokens, \
                f"sequence {seq.seq_id} has fewer pages than computed tokens"
