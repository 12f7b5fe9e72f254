"""OpenAI request objects for /v1/chat/completions and /v1/completions, validated from JSON.

Fields OpenAI defines but this server does not act on (`user`, `metadata`, `store`, ...) and
unknown fields are ignored (logged at DEBUG), as vLLM and SGLang do; every field that is read is
type- and range-checked and a bad one is a 400 naming it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from glmflash.sampling_params import MAX_SEED, MAX_TOP_K, MIN_SEED, SamplingParams
from glmflash.server.errors import bad_request
from glmflash.server.fields import Fields
from glmflash.server.messages import ToolChoice, parse_messages, parse_tool_choice, parse_tools
from glmflash.server.processors import LogitBias

logger = logging.getLogger(__name__)

MAX_N = 128
MAX_CHOICES = 4096
"""Choices (prompts x n) of one completions request: each is queued on the event loop and held
until the request ends."""
MAX_STOP_STRINGS = 4
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Token ids are below 2**31; a longer key is not one (and int() of 5000 digits raises).
_MAX_TOKEN_ID_DIGITS = 10
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SAMPLING_FIELDS = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "seed",
                    "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "logit_bias",
                    "stream", "stream_options", "logprobs"}
_CHAT_FIELDS = _SAMPLING_FIELDS | {
    "messages", "tools", "tool_choice", "parallel_tool_calls", "response_format",
    "reasoning_effort", "chat_template_kwargs", "max_completion_tokens", "top_logprobs"}
_COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "echo", "suffix"}


@dataclass
class SamplingRequest:
    """Fields both endpoints share. Sampling values left None take the server's defaults."""

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    """Number of top alternatives per token; None: no log-probabilities."""

    def to_sampling_params(self, *, max_tokens: int, defaults: Mapping[str, Any],
                           vocab_size: int, processors: Sequence = (),
                           prompt_logprobs: int | None = None,
                           keep_special_tokens: bool = False) -> SamplingParams:
        """The engine's options for this request, built in this one place: values the request
        leaves out take `defaults` (generation_config.json), then OpenAI's; token ids are
        checked against the vocabulary; logit_bias becomes the first logits processor;
        `keep_special_tokens` (the chat parsers need their tags in the text) overrides
        skip_special_tokens."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", list(self.logit_bias))):
            outside = [str(i) for i in ids if i >= vocab_size]
            if outside:
                raise bad_request(f"'{name}' holds token ids outside [0, {vocab_size}): "
                                  f"{', '.join(outside)}", name)
        bias = [LogitBias(self.logit_bias)] if self.logit_bias else []
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_pick(self.temperature, defaults.get("temperature"), 1.0),
            top_p=_pick(self.top_p, defaults.get("top_p"), 1.0),
            top_k=_pick(self.top_k, defaults.get("top_k"), 0),
            min_p=_pick(self.min_p, defaults.get("min_p"), 0.0),
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=self.logprobs, prompt_logprobs=prompt_logprobs,
            repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            skip_special_tokens=self.skip_special_tokens and not keep_special_tokens,
            logits_processors=[*bias, *processors])


@dataclass
class ChatCompletionRequest(SamplingRequest):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: str = "text"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """chat_template_kwargs with the top-level reasoning_effort folded in."""
    media: list[dict[str, Any]] = field(default_factory=list)
    """image_url / video_url parts, in order (only when the engine supports media)."""


@dataclass
class CompletionRequest(SamplingRequest):
    prompts: list[str | list[int]] = field(default_factory=list)
    echo: bool = False


def parse_chat_request(raw: Any, *, supports_media: bool = False) -> ChatCompletionRequest:
    body = Fields(raw)
    _log_ignored(body, _CHAT_FIELDS)
    request = ChatCompletionRequest(**_sampling_fields(body))
    request.max_tokens = body.integer("max_completion_tokens", request.max_tokens, lo=1)
    request.logprobs = _chat_logprobs(body)
    request.messages, request.media = parse_messages(body.array("messages", required=True),
                                                     supports_media=supports_media)
    request.tools = parse_tools(body.array("tools"))
    request.tool_choice = parse_tool_choice(body.raw.get("tool_choice"), request.tools)
    request.parallel_tool_calls = body.boolean("parallel_tool_calls", True)
    request.response_format = _response_format(body)
    request.template_kwargs = _template_kwargs(body)
    return request


def parse_completion_request(raw: Any) -> CompletionRequest:
    body = Fields(raw)
    _log_ignored(body, _COMPLETION_FIELDS)
    if body.raw.get("suffix"):
        raise bad_request("'suffix' is not supported by this server", param="suffix")
    request = CompletionRequest(**_sampling_fields(body))
    if request.max_tokens is None:
        request.max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    request.logprobs = body.integer("logprobs", lo=0, hi=MAX_COMPLETION_LOGPROBS)
    request.echo = body.boolean("echo")
    request.prompts = _prompts(body)
    if len(request.prompts) * request.n > MAX_CHOICES:
        raise body.fail("prompt", f"holds {len(request.prompts)} prompts of n = {request.n} "
                        f"choices each: at most {MAX_CHOICES} choices a request")
    return request


def _sampling_fields(body: Fields) -> dict[str, Any]:
    stream = body.boolean("stream")
    options = body.object("stream_options")
    return {
        "model": body.string("model"),
        "n": body.integer("n", 1, lo=1, hi=MAX_N),
        "max_tokens": body.integer("max_tokens", lo=1),
        "temperature": body.number("temperature", lo=0, hi=2),
        "top_p": _positive(body, "top_p", body.number("top_p", lo=0, hi=1)),
        "top_k": body.integer("top_k", lo=-1, hi=MAX_TOP_K),
        "min_p": body.number("min_p", lo=0, hi=1),
        "presence_penalty": body.number("presence_penalty", 0.0, lo=-2, hi=2),
        "frequency_penalty": body.number("frequency_penalty", 0.0, lo=-2, hi=2),
        "repetition_penalty": _positive(body, "repetition_penalty",
                                        body.number("repetition_penalty", 1.0, lo=0, hi=2)),
        "seed": body.integer("seed", lo=MIN_SEED, hi=MAX_SEED),
        "stop": _stop(body),
        "stop_token_ids": _int_list(body, "stop_token_ids"),
        "ignore_eos": body.boolean("ignore_eos"),
        "skip_special_tokens": body.boolean("skip_special_tokens", True),
        "logit_bias": _logit_bias(body),
        "stream": stream,
        "include_usage": stream and options is not None and options.boolean("include_usage"),
    }


def _pick(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _positive(body: Fields, name: str, value: float | None) -> float | None:
    if value is not None and value <= 0:
        raise body.fail(name, f"must be > 0, got {value}")
    return value


def _stop(body: Fields) -> list[str]:
    value = body.get("stop", (str, list), "a string or an array of strings", [])
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP_STRINGS:
        raise body.fail("stop", f"may hold at most {MAX_STOP_STRINGS} strings")
    if not all(isinstance(s, str) and s for s in stops):
        raise body.fail("stop", "must hold non-empty strings")
    return stops


def _int_list(body: Fields, name: str) -> list[int]:
    values = body.array(name, [])
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise body.fail(name, "must be an array of non-negative integers")
    return values


def _logit_bias(body: Fields) -> dict[int, float]:
    bias = body.object("logit_bias")
    if bias is None:
        return {}
    bad = [key for key in bias.raw
           if not (key.isascii() and key.isdigit() and len(key) <= _MAX_TOKEN_ID_DIGITS)]
    if bad:
        raise body.fail("logit_bias", f"keys must be token ids, got {', '.join(map(repr, bad))}")
    return {int(key): bias.number(key, lo=-100, hi=100) for key in bias.raw}


def _chat_logprobs(body: Fields) -> int | None:
    wanted = body.boolean("logprobs")
    top = body.integer("top_logprobs", lo=0, hi=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise body.fail("top_logprobs", "needs 'logprobs' set to true")
    return (top or 0) if wanted else None


def _response_format(body: Fields) -> str:
    fmt = body.object("response_format")
    if fmt is None:
        return "text"
    kind = fmt.string("type", required=True, choices=RESPONSE_FORMATS)
    if kind == "json_schema":
        schema = fmt.object("json_schema", required=True)
        schema.string("name", required=True)
        schema.object("schema")
        schema.boolean("strict")
    return kind


def _template_kwargs(body: Fields) -> dict[str, Any]:
    kwargs = body.object("chat_template_kwargs")
    # A JSON null is an absent value, as everywhere in a request (server/fields.py).
    merged = {k: v for k, v in kwargs.raw.items() if v is not None} if kwargs is not None else {}
    reserved = sorted({"messages", "tools", "add_generation_prompt"} & set(merged))
    if reserved:
        raise body.fail("chat_template_kwargs", f"may not set {reserved}")
    effort = body.string("reasoning_effort", choices=REASONING_EFFORTS)
    # NOTE: an explicit chat_template_kwargs value wins over the top-level field (as in vLLM).
    if effort is not None:
        merged.setdefault("reasoning_effort", effort)
    return merged


def _prompts(body: Fields) -> list[str | list[int]]:
    prompt = body.get("prompt", (str, list), "a string, an array of strings, an array of token "
                      "ids or an array of token-id arrays", required=True)
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token_id(t) for t in prompt):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    if prompt and all(isinstance(p, list) and p and all(_is_token_id(t) for t in p)
                      for p in prompt):
        return prompt
    raise body.fail("prompt", "must be a non-empty string, array of strings, array of token ids "
                    "or array of non-empty token-id arrays")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _log_ignored(body: Fields, known: set[str]) -> None:
    ignored = sorted(set(body.raw) - known)
    if ignored:
        logger.debug("ignoring request fields %s", ignored)
