"""Streaming /v1/chat/completions: `chat.completion.chunk` events (spec/chat_api.md §4.3).

Per choice: a first chunk with the role, then one chunk per parsed piece (`reasoning_content`,
`content` or one tool-call delta), then an empty delta carrying finish_reason; with
stream_options.include_usage every chunk has `usage: null` and a last chunk (no choices) has the
totals. Every delta carries `reasoning_content` (null when absent) so that reading
`delta.reasoning_content` from the OpenAI SDK never raises.
Log-probabilities of an engine delta ride on the first chunk made from it (an empty delta when
the parsers held all its text back).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from glmflash.engine.outputs import StreamDelta
from glmflash.parsers.tool_parser import ChatDelta, ChatOutputParser
from glmflash.server.async_engine import RequestGroup
from glmflash.server.chat import ChatPlan, keep_tool_call, prepare_chat
from glmflash.server.logprobs import chat_logprobs
from glmflash.server.protocol import ChatCompletionRequest
from glmflash.server.state import ServerState


class _ChoiceState:
    def __init__(self, plan: ChatPlan) -> None:
        self.parser: ChatOutputParser = plan.new_parser()
        self.token_ids: list[int] = []
        self.has_tool_calls = False


class ChatStream:
    def __init__(self, state: ServerState, request: ChatCompletionRequest, plan: ChatPlan,
                 model: str) -> None:
        self.state, self.request, self.plan = state, request, plan
        self.choices = [_ChoiceState(plan) for _ in range(request.n)]
        self.num_cached_tokens = 0
        self.header = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                       "created": int(time.time()), "model": model, "system_fingerprint": None}

    def chunk(self, index: int, delta: dict[str, Any], *, logprobs: Any = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        out = {**self.header, "choices": [choice]}
        if self.request.include_usage:
            out["usage"] = None
        return out

    def on_delta(self, delta: StreamDelta) -> list[dict[str, Any]]:
        choice = self.choices[delta.index]
        choice.token_ids += delta.token_ids
        if delta.index == 0:
            self.num_cached_tokens = delta.num_cached_tokens
        pieces = choice.parser.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += choice.parser.finish()
        deltas = [d for d in (self._openai_delta(choice, p) for p in pieces) if d is not None]
        logprobs = self._logprobs(delta)
        if logprobs is not None and not deltas:
            deltas = [{"reasoning_content": None}]
        chunks = [self.chunk(delta.index, d, logprobs=logprobs if i == 0 else None)
                  for i, d in enumerate(deltas)]
        if delta.finish_reason is not None:
            reason = self.plan.finish_reason(delta.finish_reason, choice.has_tool_calls)
            chunks.append(self.chunk(delta.index, {"reasoning_content": None},
                                     finish_reason=reason))
        return chunks

    def _openai_delta(self, choice: _ChoiceState, piece: ChatDelta) -> dict[str, Any] | None:
        if piece.tool_calls is not None:
            calls = [c for c in piece.tool_calls if keep_tool_call(self.plan, c["index"])]
            if not calls:
                return None
            choice.has_tool_calls = True
            return {"tool_calls": calls, "reasoning_content": None}
        if piece.reasoning_content is not None:
            return {"reasoning_content": piece.reasoning_content}
        return {"content": piece.content, "reasoning_content": None}

    def _logprobs(self, delta: StreamDelta) -> dict[str, Any] | None:
        if self.request.logprobs is None or not delta.token_ids:
            return None
        content = chat_logprobs(self.state.token_text, delta.token_ids, delta.logprobs or [],
                                self.request.logprobs)
        return {"content": content, "refusal": None}

    def usage_chunk(self, num_prompt_tokens: int) -> dict[str, Any]:
        num_output = sum(len(c.token_ids) for c in self.choices)
        num_reasoning = sum(self.plan.num_reasoning_tokens(c.token_ids) for c in self.choices)
        usage = {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output,
                 "total_tokens": num_prompt_tokens + num_output,
                 "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
                 "completion_tokens_details": {"reasoning_tokens": num_reasoning}}
        return {**self.header, "choices": [], "usage": usage}


async def chat_completion_stream(state: ServerState, request: ChatCompletionRequest,
                                 model: str) -> tuple[AsyncIterator[dict[str, Any]], RequestGroup]:
    """Submits before returning (so errors are plain HTTP errors); returns the chunk iterator and
    the request group (whose `close` aborts it)."""
    prepared, plan = await asyncio.to_thread(prepare_chat, state, request)
    group = state.bridge.submit(prepared.prompt_token_ids, prepared.params, request.n, "chatcmpl",
                                prepared.mm)
    stream = ChatStream(state, request, plan, model)

    async def events() -> AsyncIterator[dict[str, Any]]:
        async with group:
            for index in range(request.n):
                yield stream.chunk(index, {"role": "assistant", "content": "",
                                           "reasoning_content": None})
            async for _, delta in group:
                for chunk in stream.on_delta(delta):
                    yield chunk
        if request.include_usage:
            yield stream.usage_chunk(len(prepared.prompt_token_ids[0]))

    return events(), group
