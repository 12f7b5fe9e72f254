"""/v1/chat/completions: template rendering, engine inputs, and the non-streaming response.

Output handling (spec/chat_api.md §3, §2): the glm45 parser splits `reasoning_content` from
`content` and the glm47 parser turns `<tool_call>` markup into OpenAI tool calls, through
`ChatOutputParser`; `parsers.tool_parser.finish_reason` decides the choice's finish_reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import jinja2

from glmflash.engine.multimodal import MediaSources
from glmflash.engine.outputs import Choice
from glmflash.parsers.tags import THINK_END, THINK_START, TOOL_CALL_START
from glmflash.parsers.tool_parser import ChatOutputParser, ToolCall, finish_reason
from glmflash.sampling_params import SamplingParams
from glmflash.server.async_engine import RequestGroup
from glmflash.server.chunks import response_header, usage
from glmflash.server.engine_input import (
    PreparedRequest,
    check_prompt_size,
    max_tokens_for,
    request_hook,
    token_pieces,
)
from glmflash.server.errors import bad_request
from glmflash.server.limits import chat_texts
from glmflash.server.logprobs import chat_logprobs
from glmflash.server.processors import ForcedToolCall, ToolTokenIds
from glmflash.server.protocol import ChatCompletionRequest
from glmflash.server.state import ServerState
from glmflash.server.streaming import collect

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatPlan:
    """How the output of one chat request is parsed."""

    tools: list[dict[str, Any]] | None
    """Tools the glm47 parser accepts; None: tool parsing off."""
    use_reasoning: bool
    starts_in_reasoning: bool
    """False when the prompt already closed its think block."""
    parallel_tool_calls: bool
    reasoning_token_ids: tuple[int, ...]
    """Token ids that end the reasoning (`</think>`, `<tool_call>`)."""

    def new_parser(self) -> ChatOutputParser:
        return ChatOutputParser(self.tools, reasoning=self.use_reasoning,
                                starts_in_reasoning=self.starts_in_reasoning)

    def num_reasoning_tokens(self, token_ids: list[int]) -> int:
        if not (self.use_reasoning and self.starts_in_reasoning):
            return 0
        ends = [token_ids.index(t) for t in self.reasoning_token_ids if t in token_ids]
        return min(ends, default=len(token_ids))


def render_prompt(state: ServerState, request: ChatCompletionRequest) -> str:
    tools = request.tools if request.tool_choice.uses_tools else None
    try:
        return state.engine.tokenizer.apply_chat_template(
            request.messages, tools=tools, add_generation_prompt=True, **request.template_kwargs)
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise bad_request(f"the chat template could not render the messages: {exc}",
                          param="messages") from exc


def prepare_chat(state: ServerState, request: ChatCompletionRequest,
                 ) -> tuple[PreparedRequest, ChatPlan]:
    """Render and tokenize (blocking: off the event loop). With media, the params wait for the
    engine's expanded prompt (`PreparedRequest.params_for`)."""
    check_prompt_size(state.engine, chat_texts(request.messages), request.max_tokens, "messages")
    text = render_prompt(state, request)
    plan = _plan(state, request, text)

    def make_params(num_prompt_tokens: int) -> SamplingParams:
        max_tokens = max_tokens_for(state.engine, num_prompt_tokens, request.max_tokens,
                                    "messages")
        processors = _tool_choice_processors(state, request, plan)
        # The parsers need the tag tokens in the text, whatever the tokenizer marks special.
        return request.to_sampling_params(
            max_tokens=max_tokens, defaults=state.sampling_defaults,
            vocab_size=state.engine.config.vocab_size, processors=processors,
            keep_special_tokens=plan.tools is not None or plan.use_reasoning)

    ids = state.engine.tokenizer.encode(text)
    prepared = PreparedRequest([ids], None, text, media=_media_sources(request),
                               make_params=make_params, hook=request_hook(state, request))
    if prepared.media is None:
        prepared.params_for(ids)
    return prepared, plan


async def submit_chat(state: ServerState, prepared: PreparedRequest, n: int,
                      prefix: str) -> RequestGroup:
    """Hand the request to the engine (a chat request's media are fetched and preprocessed by
    the engine, in a worker thread); bad media are a 400 invalid_media."""
    return await state.bridge.submit(prepared.prompt_token_ids, prepared.engine_params, n,
                                     prefix, prepared.media)


def _media_sources(request: ChatCompletionRequest) -> MediaSources | None:
    if not request.media:
        return None
    return MediaSources([m["url"] for m in request.media if m["type"] == "image"],
                        [m["url"] for m in request.media if m["type"] == "video"])


def _plan(state: ServerState, request: ChatCompletionRequest, prompt: str) -> ChatPlan:
    config, tokenizer = state.config, state.engine.tokenizer
    use_tools = config.tool_call_parser != "none" and request.tool_choice.uses_tools
    ends = tuple(i for i in map(tokenizer.token_to_id, (THINK_END, TOOL_CALL_START))
                 if i is not None)
    return ChatPlan(tools=request.tools if use_tools else None,
                    use_reasoning=config.reasoning_parser != "none",
                    starts_in_reasoning=prompt.rfind(THINK_START) > prompt.rfind(THINK_END),
                    parallel_tool_calls=request.parallel_tool_calls, reasoning_token_ids=ends)


def _tool_choice_processors(state: ServerState, request: ChatCompletionRequest,
                            plan: ChatPlan) -> list:
    """tool_choice required / named: force a call to a known function after the reasoning (see
    ForcedToolCall)."""
    choice = request.tool_choice
    if plan.tools is None or choice.mode not in ("required", "function"):
        return []
    tokenizer = state.engine.tokenizer
    ids = ToolTokenIds.from_tokenizer(tokenizer)
    if ids is None:
        raise bad_request("tool_choice 'required' and named functions need the GLM tool tags in "
                          "the tokenizer", param="tool_choice")
    names = [choice.name] if choice.mode == "function" else \
        [tool["function"]["name"] for tool in plan.tools]
    banned = [*state.engine.eos_token_ids, *request.stop_token_ids]
    return [ForcedToolCall(ids, banned, [tokenizer.encode(name) for name in names],
                           starts_in_reasoning=plan.starts_in_reasoning)]


def keep_tool_call(plan: ChatPlan, index: int) -> bool:
    """parallel_tool_calls=false keeps only the first call (as vLLM does)."""
    return plan.parallel_tool_calls or index == 0


async def chat_completion(state: ServerState, request: ChatCompletionRequest,
                          model: str) -> dict[str, Any]:
    prepared, plan = await asyncio.to_thread(prepare_chat, state, request)
    group = await submit_chat(state, prepared, request.n, "chatcmpl")
    (result,) = await collect(group, 1, request.n)
    choices = [_choice(state, request, plan, c, prepared.params) for c in result.choices]
    num_output = sum(len(c.token_ids) for c in result.choices)
    num_reasoning = sum(plan.num_reasoning_tokens(c.token_ids) for c in result.choices)
    totals = usage(len(prepared.prompt_token_ids[0]), num_output,
                   result.choices[0].num_cached_tokens, num_reasoning)
    return {**response_header("chatcmpl", "chat.completion", model), "choices": choices,
            "usage": totals}


def _choice(state: ServerState, request: ChatCompletionRequest, plan: ChatPlan,
            choice: Choice, params: SamplingParams) -> dict[str, Any]:
    parsed = plan.new_parser().parse(choice.text)
    calls = [c for i, c in enumerate(parsed.tool_calls) if keep_tool_call(plan, i)]
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content,
                               "reasoning_content": parsed.reasoning_content}
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    _check_json(request, parsed.content, calls)
    logprobs = None
    if request.logprobs is not None:
        pieces = token_pieces(state.engine, params).pieces(choice.token_ids, choice.finish_reason)
        content = chat_logprobs(state.token_text, pieces,
                                choice.token_ids, choice.logprobs or [], request.logprobs)
        logprobs = {"content": content, "refusal": None}
    return {"index": choice.index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason(choice.finish_reason, bool(calls))}


def _check_json(request: ChatCompletionRequest, content: str | None,
                calls: list[ToolCall]) -> None:
    """response_format json_*: no constrained decoding here; the output is returned unchanged."""
    if request.response_format == "text" or calls:
        return
    try:
        json.loads(content or "")
    except (json.JSONDecodeError, RecursionError):
        logger.debug("response_format %s: the content is not valid JSON",
                     request.response_format)
