"""Continuous batching: admission, chunked prefill under a token budget, decode first, preemption.

No torch here: the scheduler moves `Sequence` objects and counts pages through the CacheManager.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from glmflash.engine.cache import CacheManager, CacheOps
from glmflash.engine.sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunked_prefill_size: int = 2048
    """Most new tokens per step (decodes always get theirs)."""
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        if self.max_running_requests < 1 or self.chunked_prefill_size < 1:
            raise ValueError("max_running_requests and chunked_prefill_size must be >= 1")


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]
    """New tokens scheduled per sequence."""
    needs_sample: list[bool]
    """Whether the sequence's chunk reaches its last known token (so its logits are sampled)."""
    page_updates: list[tuple[int, int, int]] = field(default_factory=list)
    """(state slot, page index, page id) handed out since the previous batch."""
    cache_ops: CacheOps | None = None
    """State snapshots and page copies of the prefix cache, applied before the forward."""
    draft_ids: list[list[int]] | None = None
    """Speculative decoding: the drafts verified after each sequence's last token (its
    `num_tokens` counts them); None when no sequence has any."""


@dataclass(slots=True)
class TokenDelta:
    seq: Sequence
    token_ids: list[int]
    finish_reason: str | None


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.config = config
        self.cache = cache
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_query_tokens = 0
        """Prompt tokens of admitted sequences (first admission), for the prefix-cache hit rate."""
        self.num_hit_tokens = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._release(seq, "abort")
                    return seq
        return None

    def schedule(self) -> ScheduledBatch | None:
        """Pick this step's work.

        Prefill vs decode is derived from the counters, never stored: a sequence's uncomputed
        tokens are `token_ids[num_computed_tokens:]`; a decode has exactly one (the last sampled
        token), a prefill more (a new prompt, or everything again after preemption). Running
        decodes go first, one token each; then running prefills continue and waiting sequences
        are admitted in FIFO order while the token budget, the running limit, state slots and
        pages allow; one whose prompt starts with a cached prefix starts after it, and only its
        uncached tokens count against the budget and pages. A running sequence that cannot get
        a page preempts the most recently admitted one (freed and later recomputed, from its
        own cached prefix if that is still there), or itself if it is the newest. A sequence
        that runs alone and still lacks pages, or cannot be admitted with its hit into an
        idle engine, is short of them for what the prefix cache pins on its behalf: it goes
        on without the cache (`Sequence.skips_prefix_cache`).
        """
        plan: dict[int, int] = {}
        budget = self.config.chunked_prefill_size
        for seq in list(self.running):
            if seq.num_uncomputed_tokens == 1 and seq in self.running:
                if seq.draft_ids and not self.cache.can_append(seq, 1 + len(seq.draft_ids)):
                    seq.draft_ids = []
                if self._reserve(seq, 1 + len(seq.draft_ids)):
                    plan[seq.seq_id] = 1 + len(seq.draft_ids)
                    budget -= plan[seq.seq_id]
        for seq in list(self.running):
            if seq.num_uncomputed_tokens > 1 and budget > 0 and seq in self.running:
                chunk = self._fit(seq, min(seq.num_uncomputed_tokens, budget))
                if not chunk and self._reserve(seq, 1):
                    # No free page: newer sequences were preempted so this one can progress.
                    chunk = self._fit(seq, min(seq.num_uncomputed_tokens, budget))
                if chunk:
                    self.cache.append(seq, chunk)
                    plan[seq.seq_id] = chunk
                    budget -= chunk
        self._admit(plan, budget)
        if not plan:
            return None
        seqs = [s for s in self.running if s.seq_id in plan]
        num_tokens = [plan[s.seq_id] for s in seqs]
        drafts = [list(s.draft_ids) for s in seqs]
        needs_sample = [s.num_computed_tokens + n - len(d) == s.num_tokens
                        for s, n, d in zip(seqs, num_tokens, drafts, strict=True)]
        return ScheduledBatch(seqs, num_tokens, needs_sample, self.cache.take_page_updates(),
                              self.cache.take_ops(), drafts if any(drafts) else None)

    def _admit(self, plan: dict[int, int], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_running_requests:
            seq = self.waiting[0]
            hit = self.cache.match(seq)
            cached = hit.num_tokens if hit else 0
            # A partial last page of the hit is copied into a new page, so it counts as room.
            room = (cached // self.cache.page_size + self.cache.num_free_pages) * \
                self.cache.page_size - cached
            chunk = min(seq.num_tokens - cached, budget, room)
            if chunk <= 0 or not self.cache.can_allocate(seq, chunk, hit):
                self.cache.release_match(hit)
                if hit is not None and not self.running:
                    # Alone, it fits (the memory plan's promise) but for what its hit pins.
                    self._skip_prefix_cache(seq)
                    continue
                break
            self.waiting.popleft()
            if seq.num_cached_tokens is None:
                self.num_query_tokens += seq.num_prompt_tokens
                self.num_hit_tokens += cached
            self.cache.allocate(seq, chunk, hit)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan[seq.seq_id] = chunk
            budget -= chunk

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `seq`'s next tokens, preempting newer sequences if needed."""
        while not self.cache.can_append(seq, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                if not self.running:
                    # Alone and short of pages: its cached prefix pins them; without the
                    # cache it fits.
                    self._skip_prefix_cache(seq)
                return False
        self.cache.append(seq, num_tokens)
        return True

    @staticmethod
    def _skip_prefix_cache(seq: Sequence) -> None:
        if not seq.skips_prefix_cache:
            seq.skips_prefix_cache = True
            logger.info("sequence %d goes on without the prefix cache: the pages its cached "
                        "prefix pins leave too few for it", seq.seq_id)

    def _fit(self, seq: Sequence, chunk: int) -> int:
        """Largest prefix of `chunk` new tokens that fits the sequence's pages plus free ones."""
        room = (len(seq.page_ids) + self.cache.num_free_pages) * self.cache.page_size
        return max(0, min(chunk, room - seq.num_computed_tokens))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq)
        seq.num_computed_tokens = 0
        seq.draft_ids = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, batch: ScheduledBatch, sampled: list[int]) -> list[TokenDelta]:
        """Advance counters; append the sampled tokens (one per `needs_sample` row, in order)."""
        return self.update_runs(batch, [[token] for token in sampled])

    def update_runs(self, batch: ScheduledBatch, runs: list[list[int]]) -> list[TokenDelta]:
        """`update` where each sampled row brings a run of tokens: a verify step's accepted
        drafts plus the target's own next token. Its computed tokens grow by the run's length
        (the last token and the accepted drafts); the tokens are appended one at a time, and
        a stop condition ends the run there."""
        deltas, runs = [], iter(runs)
        drafts = batch.draft_ids or [()] * len(batch.seqs)
        for seq, n, sample, draft in zip(batch.seqs, batch.num_tokens, batch.needs_sample,
                                         drafts, strict=True):
            run = next(runs) if sample and not seq.is_finished else None
            seq.num_computed_tokens += n if run is None else n - len(draft) + len(run) - 1
            if seq.num_computed_tokens <= seq.num_prompt_tokens:
                self.cache.cache_prefix(seq)
            if run is None:
                continue
            taken, reason = self._append_run(seq, run)
            if reason:
                self.finish(seq, reason)
            elif draft:
                self.cache.truncate(seq)
            deltas.append(TokenDelta(seq, taken, reason))
        return deltas

    def _append_run(self, seq: Sequence, run: list[int]) -> tuple[list[int], str | None]:
        for i, token in enumerate(run):
            seq.token_ids.append(token)
            reason = self._stop_reason(seq, token)
            if reason:
                return run[: i + 1], reason
        return list(run), None

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running sequence (stop condition found here or by the detokenizer)."""
        if seq in self.running:
            self.running.remove(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        self.cache.free(seq)
        seq.finish(reason)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        is_eos = token in self.eos_token_ids and not params.ignore_eos
        if token in params.stop_token_ids or is_eos:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.config.max_seq_len:
            return "length"
        return None
