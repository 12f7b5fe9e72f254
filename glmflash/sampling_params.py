"""Per-request sampling options (the public contract of Engine.generate)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from glmflash.utils.validation import is_integer, is_number, require

# Seeds are 64-bit signed integers (what every generator takes); choice i of a request with
# seed s samples with wrap_seed(s + i).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
_INT_FIELDS = ("max_tokens", "top_k", "seed", "logprobs", "prompt_logprobs")
_OPTIONAL = ("seed", "logprobs", "prompt_logprobs")
MAX_TOP_K = 2**31 - 1
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty")
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")


@dataclass
class SamplingParams:
    max_tokens: int = 64
    """Most tokens to generate."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1) means no top-k cut."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same output whatever else is in the batch."""
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the log-probabilities of this many top tokens (plus the sampled one) per step."""
    prompt_logprobs: int | None = None
    """Return, for every prompt token after the first, its log-probability given the tokens
    before it plus this many top alternatives (as vLLM); computed during prefill."""
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    logits_processors: list[Callable[[list[int], Any], Any]] = field(default_factory=list)
    """Each maps (output token ids so far, fp32 logits row `[V]`) to a new row, in order."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        require((is_integer(getattr(self, name)) or name in _OPTIONAL and getattr(self, name)
                 is None, f"{name} must be an integer") for name in _INT_FIELDS)
        require((is_number(getattr(self, name)), f"{name} must be a number")
                for name in _FLOAT_FIELDS)
        require((math.isfinite(getattr(self, name)), f"{name} must be a finite number")
                for name in _FLOAT_FIELDS)
        require((isinstance(getattr(self, name), bool), f"{name} must be true or false")
                for name in _BOOL_FIELDS)
        checks = [
            (self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.top_k <= MAX_TOP_K, f"top_k must be in [0, {MAX_TOP_K}] (or -1 for no "
             "cut)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be in [0, 20]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(is_integer(t) for t in self.stop_token_ids), "stop_token_ids must be integers"),
            (self.seed is None or MIN_SEED <= self.seed <= MAX_SEED,
             f"seed must be in [{MIN_SEED}, {MAX_SEED}]"),
        ]
        require(checks)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


def wrap_seed(seed: int) -> int:
    """`seed` folded into [MIN_SEED, MAX_SEED] (two's complement), e.g. for derived seeds."""
    return (seed - MIN_SEED) % 2**64 + MIN_SEED
