"""A validated request becomes engine input here, in one step per endpoint: the prompt's size
checked against the context, the output budget, the SamplingParams (built once, by the request's
`to_sampling_params`), the test hook. Chat requests with images or video hand their sources to
the engine, which expands the prompt and then asks `PreparedRequest.params_for` for the params of
the final prompt (so the budget counts the media tokens)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmflash.engine.multimodal import MediaSources
from glmflash.sampling_params import SamplingParams
from glmflash.server.errors import context_length_exceeded
from glmflash.server.limits import min_num_tokens
from glmflash.server.logprobs import TokenPieces

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine
    from glmflash.server.state import ServerState


@dataclass
class PreparedRequest:
    """Engine inputs for one HTTP request; the test-only request hook may replace `params`."""

    prompt_token_ids: list[list[int]]
    """Per prompt; for a chat request with media, the expanded prompt once the engine made it."""
    params: SamplingParams | None
    """None until `params_for` ran (a chat request with media, before submission)."""
    prompt_text: str | None = None
    """The rendered chat prompt (chat requests only)."""
    media: MediaSources | None = None
    """The chat request's image / video sources (fetched and preprocessed by the engine)."""
    make_params: Callable[[int], SamplingParams] | None = None
    hook: Callable[[PreparedRequest], None] | None = None

    def params_for(self, prompt_token_ids: list[int]) -> SamplingParams:
        """The params of the final prompt (its budget depends on its length), built once."""
        assert self.make_params is not None
        self.prompt_token_ids = [prompt_token_ids]
        self.params = self.make_params(len(prompt_token_ids))
        if self.hook is not None:
            self.hook(self)
        return self.params

    @property
    def engine_params(self) -> SamplingParams | Callable[[list[int]], SamplingParams]:
        """What `Engine.add_request` takes: the params, or how to make them once the engine
        has expanded the prompt's media."""
        return self.params if self.params is not None else self.params_for


RequestHook = Callable[[Any, PreparedRequest], None]


def check_prompt_size(engine: Engine, texts: Iterable[str], requested: int | None,
                      param: str) -> None:
    """context_length_exceeded before tokenizing when the text alone cannot fit."""
    num_tokens = min_num_tokens(texts, engine.tokenizer.max_token_bytes)
    if num_tokens >= engine.max_seq_len:
        raise context_length_exceeded(engine.max_seq_len, num_tokens, requested, param,
                                      at_least=True)


def max_tokens_for(engine: Engine, num_prompt_tokens: int, requested: int | None,
                   param: str) -> int:
    """The request's output budget; 400 context_length_exceeded when it cannot fit."""
    max_len = engine.max_seq_len
    if num_prompt_tokens >= max_len:
        raise context_length_exceeded(max_len, num_prompt_tokens, requested, param)
    if requested is None:
        return max_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_len:
        raise context_length_exceeded(max_len, num_prompt_tokens, requested, param)
    return requested


def request_hook(state: ServerState, request: Any) -> Callable[[PreparedRequest], None] | None:
    """The test-only hook bound to `request` (None when the server has none)."""
    hook = state.request_hook
    return None if hook is None else (lambda prepared: hook(request, prepared))


def token_pieces(engine: Engine, params: SamplingParams) -> TokenPieces:
    """Per-token text of one choice's output (its logprob tokens)."""
    stops = set(params.stop_token_ids)
    if not params.ignore_eos:
        stops |= engine.eos_token_ids
    return TokenPieces(engine.tokenizer, skip_special_tokens=params.skip_special_tokens,
                       stop_token_ids=stops)
