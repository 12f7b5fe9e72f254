"""When speculative decoding drafts, and what it has achieved (no torch).

Drafting pays while decode has idle compute: it is off while more sequences than
`speculative_max_batch_size` run, and it pauses while the acceptance of first drafts over the
latest window is below `speculative_min_acceptance` (tried again after a pause). An acceptance
near zero is a warning: the MTP layer is probably broken (a known failure of MTP heads).
Acceptance alone does not say that drafting pays: a verify step can cost more than the tokens it
gains (an eager verify against graph-replayed decodes, experts on the CPU without routing
overlap). So `SpeedCheck` measures decode tokens/s with drafts and then without (steps that
still keep the MTP layer's cache, engine/speculative.py), in turn, and holds drafting off for a
while when it was the slower (logged), measuring again later.
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
WARMUP_STEPS = 4
"""Drafting decode steps not measured at first (kernels compile on the first verifies)."""
SPEED_STEPS = 8
"""Decode steps measured on each side of a comparison."""
RECHECK_STEPS = 2048
"""Steps between comparisons while drafting pays."""
SLOW_PAUSE_STEPS = 2048
"""Steps without drafts after drafting measured slower."""
MAX_BATCH_RATIO = 1.5
"""The two sides' mean batch sizes must be this close for a comparison to count."""


class AcceptanceFigures:
    """Rates from `num_draft_tokens`, `num_accepted_tokens` and `num_verify_steps` (a choice's
    or the engine's counters)."""

    __slots__ = ()

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a sequence gains per verify step (accepted drafts plus the target's own;
        a run cut by a stop counts what it output, `SpecDecoder.count_output`)."""
        if not self.num_verify_steps:
            return 0.0
        return 1 + self.num_accepted_tokens / self.num_verify_steps


@dataclass(frozen=True, slots=True)
class SpecCounters(AcceptanceFigures):
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


@dataclass(slots=True)
class _Speed:
    num_steps: int = 0
    seconds: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0

    def add(self, num_seqs: int, num_tokens: int, seconds: float) -> None:
        self.num_steps += 1
        self.seconds += seconds
        self.num_tokens += num_tokens
        self.num_seqs += num_seqs

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_batch(self) -> float:
        return self.num_seqs / max(self.num_steps, 1)


class SpeedCheck:
    """Decode tokens/s with drafts against without, measured in turn on the running batches.

    Phases: "warmup" (the first drafting steps, not measured), "drafts" (measuring drafting
    steps), "plain" (drafting held off while plain steps are measured), then "pays" (drafting on
    until the next comparison) or "slow" (drafting held off until then)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.phase, self.wait = "warmup", WARMUP_STEPS
        self.drafted, self.plain = _Speed(), _Speed()

    @property
    def holds_off(self) -> bool:
        return self.phase in ("plain", "slow")

    def tick(self) -> None:
        """One engine step has passed."""
        if self.phase in ("pays", "slow") and self.wait:
            self.wait -= 1
            if not self.wait:
                self._measure_again()

    def observe(self, drafted: bool, num_seqs: int, num_tokens: int, seconds: float) -> None:
        """A step of decodes only (no prefill chunk): `num_tokens` emitted by `num_seqs`
        sequences in `seconds`, with drafts verified or not."""
        if not self.enabled:
            return
        if self.phase == "warmup" and drafted:
            self.wait -= 1
            if self.wait <= 0:
                self.phase = "drafts"
        elif self.phase == "drafts" and drafted:
            self.drafted.add(num_seqs, num_tokens, seconds)
            if self.drafted.num_steps >= SPEED_STEPS:
                self.phase = "plain"
        elif self.phase == "plain" and not drafted:
            self.plain.add(num_seqs, num_tokens, seconds)
            if self.plain.num_steps >= SPEED_STEPS:
                self._judge()

    def _judge(self) -> None:
        drafted, plain = self.drafted, self.plain
        ratio = drafted.mean_batch / max(plain.mean_batch, 1e-9)
        if not 1 / MAX_BATCH_RATIO <= ratio <= MAX_BATCH_RATIO:
            self._measure_again()  # the load changed under the comparison
            return
        if drafted.tokens_per_s < plain.tokens_per_s:
            logger.info("speculative decoding: drafting off for %d steps: %.1f decode tokens/s "
                        "with drafts, %.1f without", SLOW_PAUSE_STEPS, drafted.tokens_per_s,
                        plain.tokens_per_s)
            self.phase, self.wait = "slow", SLOW_PAUSE_STEPS
        else:
            logger.debug("speculative decoding pays: %.1f decode tokens/s with drafts, %.1f "
                         "without", drafted.tokens_per_s, plain.tokens_per_s)
            self.phase, self.wait = "pays", RECHECK_STEPS

    def _measure_again(self) -> None:
        self.phase = "drafts"
        self.drafted, self.plain = _Speed(), _Speed()


class DraftPolicy:
    def __init__(self, max_batch_size: int, min_acceptance: float,
                 check_speed: bool = True) -> None:
        self.max_batch_size, self.min_acceptance = max_batch_size, min_acceptance
        self.window: deque[tuple[int, int]] = deque()
        self.num_window_drafts = self.num_window_accepted = 0
        self.num_paused_steps = 0
        self.is_batch_too_large = False
        self.speed = SpeedCheck(enabled=check_speed)

    @property
    def is_drafting(self) -> bool:
        return not self.num_paused_steps and not self.is_batch_too_large \
            and not self.speed.holds_off

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
        self.speed.tick()
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
