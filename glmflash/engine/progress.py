"""Progress of long prefills in the log: a prompt of at least `MIN_CHUNKS` chunks is reported
when it starts, at each tenth of its prompt, and when its prefill ends (tokens, seconds, rate).
Decodes of other requests run between its chunks, so the log also shows that the engine stays
live during minutes-long prefills."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.sequence import Sequence

logger = logging.getLogger(__name__)
MIN_CHUNKS = 4
STEPS = 10


@dataclass(slots=True)
class _Prefill:
    start_s: float
    reported: int
    """Tenths of the prompt already reported."""


class PrefillProgress:
    """Watches each step's prefill chunks (no state on the sequences themselves)."""

    def __init__(self, chunk_size: int) -> None:
        self.min_tokens = MIN_CHUNKS * chunk_size
        self.active: dict[int, _Prefill] = {}

    def observe(self, batch: ScheduledBatch, step_start_s: float,
                name_of: Callable[[Sequence], str]) -> None:
        """After `Scheduler.update`: report the long prefills this step (begun at
        `step_start_s`, perf_counter) advanced."""
        for seq, num_tokens in zip(batch.seqs, batch.num_tokens, strict=True):
            if num_tokens > 1 and seq.num_prompt_tokens >= self.min_tokens:
                self._advance(seq, num_tokens, name_of(seq), step_start_s)

    def release(self, seq: Sequence) -> None:
        self.active.pop(seq.seq_id, None)

    def _advance(self, seq: Sequence, num_tokens: int, name: str, step_start_s: float) -> None:
        done, total = min(seq.num_computed_tokens, seq.num_prompt_tokens), seq.num_prompt_tokens
        entry = self.active.get(seq.seq_id)
        if entry is None or done == num_tokens:
            # First chunk (or a restart after preemption): timed from this step's start.
            entry = self.active[seq.seq_id] = _Prefill(step_start_s, 0)
            logger.info("request %s: prefilling %d prompt tokens", name, total)
        elapsed = max(time.perf_counter() - entry.start_s, 1e-9)
        if done >= total:
            logger.info("request %s: prefilled %d tokens in %.1f s (%.0f tokens/s)", name, total,
                        elapsed, done / elapsed)
            del self.active[seq.seq_id]
            return
        tenths = done * STEPS // total
        if tenths > entry.reported:
            entry.reported = tenths
            logger.info("request %s: prefill %d / %d tokens (%d%%), %.1f s", name, done, total,
                        100 * done // total, elapsed)
