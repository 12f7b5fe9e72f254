"""What every route shares: the engine bridge, served names, parser switches, sampling defaults,
and turning a validated request into engine inputs (`PreparedRequest`)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmflash.sampling_params import SamplingParams
from glmflash.server.args import DEFAULT_GRACEFUL_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from glmflash.server.async_engine import AsyncEngine
from glmflash.server.errors import (
    bad_request,
    context_length_exceeded,
    model_not_found,
    unavailable,
)
from glmflash.server.lifecycle import Lifecycle
from glmflash.server.limits import max_json_separators, min_num_tokens
from glmflash.server.logprobs import TokenPieces, TokenText
from glmflash.server.processors import LogitBias
from glmflash.server.protocol import SamplingRequest
from glmflash.server.responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine

logger = logging.getLogger(__name__)

# generation_config.json keys a request that omits them inherits (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    """The first name is the primary one (reported when a request omits `model`)."""
    api_key: str | None = None
    tool_call_parser: str = "glm47"
    """glm47, or none (tool-call markup stays in `content`)."""
    reasoning_parser: str = "glm45"
    """glm45, or none (reasoning stays in `content`)."""
    graceful_shutdown_timeout_s: float = DEFAULT_GRACEFUL_TIMEOUT_S
    """After SIGINT/SIGTERM, how long running requests may go on before they are ended."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Larger request bodies are answered 413 without being read."""
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    """/v1/responses kept for previous_response_id (least recently used dropped first)."""


@dataclass
class PreparedRequest:
    """Engine inputs for one HTTP request; the test-only request hook may replace `params`."""

    prompt_token_ids: list[list[int]]
    params: SamplingParams
    prompt_text: str | None = None
    """The rendered chat prompt (chat requests only)."""
    mm: list[Any] | None = None
    """Per prompt, the engine's MultimodalPrompt (chat requests with images or video)."""


RequestHook = Callable[[Any, PreparedRequest], None]


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig,
                 request_hook: RequestHook | None = None) -> None:
        self.engine = engine
        self.bridge = AsyncEngine(engine)
        self.lifecycle = Lifecycle(self.bridge, config.graceful_shutdown_timeout_s)
        self.config = config
        self.request_hook = request_hook
        self.created = int(time.time())
        self.token_text = TokenText(engine.tokenizer)
        self.responses = ResponseStore(config.max_stored_responses)
        self.sampling_defaults = read_generation_defaults(engine.model_path)
        self.max_json_separators = max_json_separators(engine.max_seq_len)
        logger.debug("prompt bound: at most %d bytes per token", engine.tokenizer.max_token_bytes)

    def check_admitting(self) -> None:
        """503 once the server drains for shutdown or its engine has died."""
        if self.lifecycle.is_draining or self.bridge.is_closed:
            raise unavailable("The server is shutting down.", "shutting_down")

    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.config.served_model_names[0]
        if name not in self.config.served_model_names:
            raise model_not_found(name)
        return name

    def check_prompt_size(self, texts: Iterable[str], requested: int | None, param: str) -> None:
        """context_length_exceeded before tokenizing when the text alone cannot fit."""
        num_tokens = min_num_tokens(texts, self.engine.tokenizer.max_token_bytes)
        if num_tokens >= self.engine.max_seq_len:
            raise context_length_exceeded(self.engine.max_seq_len, num_tokens, requested, param,
                                          at_least=True)

    def max_tokens_for(self, num_prompt_tokens: int, requested: int | None, param: str) -> int:
        """The request's output budget; 400 context_length_exceeded when it cannot fit."""
        max_len = self.engine.max_seq_len
        if num_prompt_tokens >= max_len:
            raise context_length_exceeded(max_len, num_prompt_tokens, requested, param)
        if requested is None:
            return max_len - num_prompt_tokens
        if num_prompt_tokens + requested > max_len:
            raise context_length_exceeded(max_len, num_prompt_tokens, requested, param)
        return requested

    def sampling_params(self, request: SamplingRequest, max_tokens: int,
                        processors: list | None = None, *,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        vocab_size = self.engine.config.vocab_size
        for name, ids in (("stop_token_ids", request.stop_token_ids),
                          ("logit_bias", list(request.logit_bias))):
            outside = [str(i) for i in ids if i >= vocab_size]
            if outside:
                raise bad_request(f"'{name}' holds token ids outside [0, {vocab_size}): "
                                  f"{', '.join(outside)}", name)
        processors = list(processors or [])
        if request.logit_bias:
            processors.insert(0, LogitBias(request.logit_bias))
        defaults = self.sampling_defaults
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_pick(request.temperature, defaults.get("temperature"), 1.0),
            top_p=_pick(request.top_p, defaults.get("top_p"), 1.0),
            top_k=_pick(request.top_k, defaults.get("top_k"), 0),
            min_p=_pick(request.min_p, defaults.get("min_p"), 0.0),
            seed=request.seed, stop=request.stop, stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos, logprobs=request.logprobs,
            prompt_logprobs=prompt_logprobs,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            skip_special_tokens=request.skip_special_tokens, logits_processors=processors)

    def token_pieces(self, params: SamplingParams) -> TokenPieces:
        """Per-token text of one choice's output (its logprob tokens)."""
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= self.engine.eos_token_ids
        return TokenPieces(self.engine.tokenizer, skip_special_tokens=params.skip_special_tokens,
                           stop_token_ids=stops)

    def run_hook(self, request: Any, prepared: PreparedRequest) -> None:
        if self.request_hook is not None:
            self.request_hook(request, prepared)


def _pick(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def read_generation_defaults(model_path: Path) -> dict[str, Any]:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    defaults = {k: config[k] for k in _GENERATION_DEFAULTS if config.get(k) is not None}
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    return defaults
