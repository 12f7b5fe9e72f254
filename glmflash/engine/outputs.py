"""What the engine hands back: streamed deltas per choice, and finished results."""

from __future__ import annotations

from dataclasses import dataclass

from glmflash.engine.cache import PrefixCacheStats
from glmflash.engine.spec_policy import AcceptanceFigures, SpecCounters


@dataclass(slots=True)
class StreamDelta:
    """New output of one choice of one request since the previous delta."""

    request_id: str
    index: int
    """Choice index (0..n-1)."""
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    """stop, length, abort or error once the choice has ended."""
    logprobs: list[dict[int, float]] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """On a choice's first delta when SamplingParams.prompt_logprobs was set: per prompt token
    {token id: logprob} of it and the top alternatives, None for the first token."""
    num_cached_tokens: int = 0
    """Prompt tokens this choice took from the prefix cache."""
    speculative: tuple[int, int, int] | None = None
    """On a choice's last delta: (drafts verified, drafts accepted, verify steps with drafts)."""


@dataclass
class Choice(AcceptanceFigures):
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache (not computed again)."""
    num_draft_tokens: int = 0
    """Speculative decoding: drafts verified for this choice, `num_accepted_tokens` of them
    accepted, over `num_verify_steps` steps that had drafts."""
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0


@dataclass
class Result:
    """One prompt's output; the top-level fields are those of choice 0."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[Choice]
    error: str | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """See StreamDelta.prompt_logprobs (the same for every choice)."""

    @property
    def token_ids(self) -> list[int]:
        return self.choices[0].token_ids

    @property
    def text(self) -> str:
        return self.choices[0].text

    @property
    def finish_reason(self) -> str:
        return self.choices[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.choices[0].logprobs

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (choice 0's; usage counts the prompt once)."""
        return self.choices[0].num_cached_tokens

    @property
    def acceptance_rate(self) -> float:
        """Speculative decoding: accepted / verified drafts of choice 0 (0 without drafts)."""
        return self.choices[0].acceptance_rate

    @property
    def mean_accepted_length(self) -> float:
        """Speculative decoding: choice 0's tokens per verify step."""
        return self.choices[0].mean_accepted_length


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's load at the end of a step: one consistent snapshot, taken on the engine
    thread, that any thread may read (`Engine.stats()`)."""

    num_queued: int
    """Choices waiting for admission."""
    num_running: int
    """Choices being generated."""
    num_free_pages: int
    num_pages: int
    prefix_cache: PrefixCacheStats
    """The prefix cache's counters (zeros when it is off)."""
    speculative: SpecCounters | None = None
    """Speculative decoding's counters (None when it is off)."""

    @property
    def cache_usage(self) -> float:
        """Fraction of cache pages in use."""
        return 1.0 - self.num_free_pages / self.num_pages


class ResultCollector:
    """Folds a request's deltas into a Result."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], n: int) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.choices = [Choice(i, [], "", "") for i in range(n)]
        self.error: str | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, delta: StreamDelta) -> None:
        choice = self.choices[delta.index]
        choice.token_ids += delta.token_ids
        choice.text += delta.text
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
        if delta.finish_reason:
            choice.finish_reason = delta.finish_reason
            choice.num_cached_tokens = delta.num_cached_tokens
        if delta.speculative is not None:
            (choice.num_draft_tokens, choice.num_accepted_tokens,
             choice.num_verify_steps) = delta.speculative
        if delta.error:
            self.error = delta.error
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs

    @property
    def is_done(self) -> bool:
        return all(c.finish_reason for c in self.choices)

    def result(self) -> Result:
        return Result(self.request_id, self.prompt_token_ids, self.choices, self.error,
                      self.prompt_logprobs)
