"""When speculative decoding drafts, and what it has achieved (no torch).

Drafting pays while decode has idle compute: it is off while more sequences than
`speculative_max_batch_size` run, and it pauses while the acceptance of first drafts over the
latest window is below `speculative_min_acceptance` (tried again after a pause). An acceptance
near zero is a warning: the MTP layer is probably broken (a known failure of MTP heads).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

logger = logging.getLogger(__name__)

WINDOW = 64
"""First drafts over which acceptance is measured."""
PAUSE_STEPS = 256
"""Steps without drafts after acceptance fell below the minimum."""
NEAR_ZERO = 0.05


@dataclass(frozen=True, slots=True)
class SpecCounters:
    """Speculative decoding so far (Engine.stats().speculative, /metrics)."""

    num_verify_steps: int
    """Sequence-steps that verified drafts."""
    num_draft_tokens: int
    num_accepted_tokens: int
    drafts_per_position: tuple[int, ...]
    """Drafts made at chain position j (0: the first draft)."""
    accepted_per_position: tuple[int, ...]
    is_drafting: bool = True
    """Whether the policy lets sequences draft now."""

    @classmethod
    def empty(cls, num_steps: int) -> SpecCounters:
        return cls(0, 0, 0, (0,) * num_steps, (0,) * num_steps)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verify step (accepted drafts plus the target's own)."""
        if not self.num_verify_steps:
            return 0.0
        return 1 + self.num_accepted_tokens / self.num_verify_steps

    def position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in
                zip(self.accepted_per_position, self.drafts_per_position, strict=True)]

    def add(self, num_drafts: int, num_accepted: int) -> SpecCounters:
        """These counters after one sequence's verify of `num_drafts` drafts."""
        drafted = tuple(d + (j < num_drafts) for j, d in enumerate(self.drafts_per_position))
        accepted = tuple(a + (j < num_accepted) for j, a in
                         enumerate(self.accepted_per_position))
        return replace(self, num_verify_steps=self.num_verify_steps + 1,
                       num_draft_tokens=self.num_draft_tokens + num_drafts,
                       num_accepted_tokens=self.num_accepted_tokens + num_accepted,
                       drafts_per_position=drafted, accepted_per_position=accepted)

    def with_drafting(self, is_drafting: bool) -> SpecCounters:
        return replace(self, is_drafting=is_drafting)


class DraftPolicy:
    def __init__(self, max_batch_size: int, min_acceptance: float) -> None:
        self.max_batch_size, self.min_acceptance = max_batch_size, min_acceptance
        self.window: deque[tuple[int, int]] = deque()
        self.num_window_drafts = self.num_window_accepted = 0
        self.num_paused_steps = 0
        self.is_batch_too_large = False

    @property
    def is_drafting(self) -> bool:
        return not self.num_paused_steps and not self.is_batch_too_large

    def allows(self, num_running: int) -> bool:
        """Whether sequences draft now, with `num_running` sequences running (logged when the
        batch size turns drafting on or off)."""
        too_large = num_running > self.max_batch_size
        if too_large != self.is_batch_too_large:
            logger.info("speculative decoding: drafting %s (%d sequences running, limit %d)",
                        "off" if too_large else "on again", num_running, self.max_batch_size)
            self.is_batch_too_large = too_large
        return self.is_drafting

    def tick(self) -> None:
        """One engine step has passed (it counts down a pause)."""
        if self.num_paused_steps:
            self.num_paused_steps -= 1
            if not self.num_paused_steps:
                logger.info("speculative decoding: drafting again after a pause")

    def observe(self, num_first_drafts: int, num_first_accepted: int) -> None:
        """One step's first drafts and how many were accepted."""
        if self.num_paused_steps or not num_first_drafts:
            return
        self.window.append((num_first_drafts, num_first_accepted))
        self.num_window_drafts += num_first_drafts
        self.num_window_accepted += num_first_accepted
        while self.num_window_drafts - self.window[0][0] >= WINDOW:
            drafts, accepted = self.window.popleft()
            self.num_window_drafts -= drafts
            self.num_window_accepted -= accepted
        if self.num_window_drafts >= WINDOW:
            self._judge(self.num_window_accepted / self.num_window_drafts)

    def _judge(self, rate: float) -> None:
        if rate < NEAR_ZERO:
            logger.warning("speculative decoding: the MTP layer's first drafts are accepted "
                           "%.1f%% of the time over the last %d; is the MTP layer broken?",
                           100 * rate, self.num_window_drafts)
        if rate < self.min_acceptance:
            logger.info("speculative decoding: acceptance %.2f is below %.2f; drafting pauses "
                        "for %d steps", rate, self.min_acceptance, PAUSE_STEPS)
            self.num_paused_steps = PAUSE_STEPS
            self.window.clear()
            self.num_window_drafts = self.num_window_accepted = 0
