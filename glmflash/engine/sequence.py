"""A request's mutable state as it flows through the engine (no torch here)."""

from __future__ import annotations

from array import array
from enum import Enum

from glmflash.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids grow as tokens are sampled; prefill vs decode is derived from the counters."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("a prompt needs at least one token")
        self.seq_id = seq_id
        self.token_ids = array("q", prompt_token_ids)
        """Prompt then output ids. NOTE: an int64 array, not a list: Python's cyclic garbage
        collector traverses every element of a list on each full collection (32 x 128K-token
        lists: ~30 ms), which made host time per step grow with context."""
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.params = params
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        """Per prompt token so far, {token id: logprob} of the token and the top alternatives
        (None for the first token); None when not asked. NOTE: these come from the prefill's
        logits, so a prefix cache must not skip the positions still missing here (a request
        that asks simply bypasses the cache)."""
        self.state_slot: int | None = None
        self.page_ids: list[int] = []
        self.prompt_embeds = None
        """`[num_prompt_tokens, D]` input embeddings with visual features (multimodal prompts)."""
        self.media_key: array | None = None
        """The prompt's prefix-cache key when it has media: token ids with each run of media
        placeholders replaced by a hash of its features (negative, so never a token id)."""
        self.num_cached_tokens: int | None = None
        """Prompt tokens taken from the prefix cache at the first admission."""
        self.cache_node = None
        """The deepest prefix-cache node this sequence uses (locked while it runs)."""
        self.skips_prefix_cache = False
        """Set by the scheduler when the pages a cached prefix pins (the tree's copy of a
        partial page, nodes it shares) leave too few for this sequence alone: it then neither
        starts from nor adds to the prefix cache, so every page the tree holds can be evicted
        for it."""
        self.draft_ids: list[int] = []
        """Speculative decoding: tokens the MTP layer proposes after the last token, verified
        by the next step (never part of `token_ids` before they are accepted)."""
        self.num_draft_tokens = 0
        """Drafts verified so far; `num_accepted_tokens` of them were accepted, over
        `num_verify_steps` steps that had drafts."""
        self.num_accepted_tokens = 0
        self.num_verify_steps = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def cache_key(self) -> array:
        """Prefix-cache key of the prompt (its first `num_prompt_tokens` entries are used)."""
        return self.token_ids if self.media_key is None else self.media_key

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
