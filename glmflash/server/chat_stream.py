"""Streaming /v1/chat/completions: `chat.completion.chunk` events (spec/chat_api.md §4.3).

Per choice: a first chunk with the role, then one chunk per parsed piece (`reasoning_content`,
`content` or one tool-call delta), then an empty delta carrying finish_reason; with
stream_options.include_usage every chunk has `usage: null` and a last chunk (no choices) has the
totals. Every delta carries `reasoning_content` (null when absent) so that reading
`delta.reasoning_content` from the OpenAI SDK never raises.
Log-probabilities travel with text: a token's entry waits until a chunk with content, reasoning
or a tool call is sent (its bytes may be an incomplete UTF-8 character, or markup the parsers
hold back) and rides on it; what is left at the end rides on the finish_reason chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from glmflash.engine.outputs import StreamDelta
from glmflash.parsers.tool_parser import ChatDelta, ChatOutputParser, finish_reason
from glmflash.sampling_params import SamplingParams
from glmflash.server.async_engine import RequestGroup
from glmflash.server.chat import ChatPlan, keep_tool_call, prepare_chat, submit_chat
from glmflash.server.chunks import response_header, stream_chunk, usage, usage_chunk
from glmflash.server.engine_input import token_pieces
from glmflash.server.logprobs import TokenPieces, chat_logprobs
from glmflash.server.protocol import ChatCompletionRequest
from glmflash.server.state import ServerState


class _ChoiceState:
    def __init__(self, plan: ChatPlan, pieces: TokenPieces) -> None:
        self.parser: ChatOutputParser = plan.new_parser()
        self.pieces = pieces
        self.token_ids: list[int] = []
        self.unsent_logprobs: list[dict[str, Any]] = []
        self.has_tool_calls = False

    def take_logprobs(self) -> dict[str, Any] | None:
        if not self.unsent_logprobs:
            return None
        content, self.unsent_logprobs = self.unsent_logprobs, []
        return {"content": content, "refusal": None}


class ChatStream:
    def __init__(self, state: ServerState, request: ChatCompletionRequest, plan: ChatPlan,
                 model: str, params: SamplingParams) -> None:
        self.state, self.request, self.plan = state, request, plan
        self.choices = [_ChoiceState(plan, token_pieces(state.engine, params))
                        for _ in range(request.n)]
        self.header = response_header("chatcmpl", "chat.completion.chunk", model)
        self.num_cached_tokens = 0

    def chunk(self, index: int, delta: dict[str, Any], *, logprobs: Any = None,
              reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return stream_chunk(self.header, choice, self.request.include_usage)

    def on_delta(self, delta: StreamDelta) -> list[dict[str, Any]]:
        choice = self.choices[delta.index]
        choice.token_ids += delta.token_ids
        if delta.index == 0:
            self.num_cached_tokens = delta.num_cached_tokens
        pieces = choice.parser.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += choice.parser.finish()
        deltas = [d for d in (self._openai_delta(choice, p) for p in pieces) if d is not None]
        self._add_logprobs(choice, delta)
        chunks = [self.chunk(delta.index, d, logprobs=choice.take_logprobs() if i == 0 else None)
                  for i, d in enumerate(deltas)]
        if delta.finish_reason is not None:
            reason = finish_reason(delta.finish_reason, choice.has_tool_calls)
            chunks.append(self.chunk(delta.index, {"reasoning_content": None},
                                     logprobs=choice.take_logprobs(), reason=reason))
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

    def _add_logprobs(self, choice: _ChoiceState, delta: StreamDelta) -> None:
        if self.request.logprobs is None or not delta.token_ids:
            return
        pieces = choice.pieces.pieces(delta.token_ids, delta.finish_reason)
        choice.unsent_logprobs += chat_logprobs(self.state.token_text, pieces, delta.token_ids,
                                                delta.logprobs or [], self.request.logprobs)

    def usage_chunk(self, num_prompt_tokens: int) -> dict[str, Any]:
        num_output = sum(len(c.token_ids) for c in self.choices)
        num_reasoning = sum(self.plan.num_reasoning_tokens(c.token_ids) for c in self.choices)
        return usage_chunk(self.header, usage(num_prompt_tokens, num_output,
                                              self.num_cached_tokens, num_reasoning))


async def chat_completion_stream(state: ServerState, request: ChatCompletionRequest,
                                 model: str) -> tuple[AsyncIterator[dict[str, Any]], RequestGroup]:
    """Submits before returning (so errors are plain HTTP errors); returns the chunk iterator and
    the request group (whose `close` aborts it)."""
    prepared, plan = await asyncio.to_thread(prepare_chat, state, request)
    group = await submit_chat(state, prepared, request.n, "chatcmpl")
    stream = ChatStream(state, request, plan, model, prepared.params)

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
