"""/v1/completions: raw prompts (no template, no parsers), streaming or not (spec §4.4).

Choices are numbered prompt-major: choice `p * n + i` is the i-th sample of prompt p.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from glmflash.engine.outputs import StreamDelta
from glmflash.server.async_engine import RequestGroup
from glmflash.server.chunks import response_header, stream_chunk, usage, usage_chunk
from glmflash.server.engine_input import (
    PreparedRequest,
    check_prompt_size,
    max_tokens_for,
    request_hook,
    token_pieces,
)
from glmflash.server.errors import bad_request
from glmflash.server.logprobs import CompletionLogprobs, TokenPieces
from glmflash.server.protocol import CompletionRequest
from glmflash.server.state import ServerState
from glmflash.server.streaming import collect


def prepare_completion(state: ServerState, request: CompletionRequest) -> PreparedRequest:
    engine = state.engine
    for prompt in request.prompts:
        if isinstance(prompt, str):
            check_prompt_size(engine, [prompt], request.max_tokens, "prompt")
    prompts = [p if isinstance(p, list) else engine.tokenizer.encode(p) for p in request.prompts]
    if not all(prompts):
        raise bad_request("'prompt' must not be empty", param="prompt")
    for ids in prompts:
        max_tokens_for(engine, len(ids), request.max_tokens, "prompt")
    params = request.to_sampling_params(
        max_tokens=request.max_tokens, defaults=state.sampling_defaults,
        vocab_size=engine.config.vocab_size,
        prompt_logprobs=request.logprobs if request.echo else None)
    prepared = PreparedRequest(prompts, params)
    hook = request_hook(state, request)
    if hook is not None:
        hook(prepared)
    return prepared


def _echo_texts(state: ServerState, request: CompletionRequest,
                prepared: PreparedRequest) -> list[str]:
    if not request.echo:
        return [""] * len(prepared.prompt_token_ids)
    return [p if isinstance(p, str) else state.engine.tokenizer.decode(ids)
            for p, ids in zip(request.prompts, prepared.prompt_token_ids, strict=True)]


class ChoiceLogprobs:
    """One choice's `logprobs` object (the echoed prompt's tokens first), and the entries a
    stream has not sent yet: they go out with the chunk whose text they make."""

    def __init__(self, state: ServerState, request: CompletionRequest,
                 prepared: PreparedRequest) -> None:
        self.data = CompletionLogprobs(state.token_text, request.logprobs or 0)
        self.pieces = token_pieces(state.engine, prepared.params)
        self.tokenizer = state.engine.tokenizer
        self.num_sent = 0

    def add_prompt(self, token_ids: list[int],
                   prompt_logprobs: list[dict[int, float] | None] | None) -> None:
        assert prompt_logprobs is not None and len(prompt_logprobs) == len(token_ids)
        pieces = TokenPieces(self.tokenizer, skip_special_tokens=False).whole(token_ids)
        self.data.add(pieces, token_ids, prompt_logprobs)

    def add(self, token_ids: list[int], logprobs: list[dict[int, float]] | None,
            finish_reason: str | None) -> None:
        self.data.add(self.pieces.pieces(token_ids, finish_reason), token_ids, logprobs or [])

    def take_unsent(self) -> dict[str, list]:
        part = {key: values[self.num_sent:] for key, values in self.data.data.items()}
        self.num_sent = len(self.data.data["tokens"])
        return part


def _header(model: str) -> dict[str, Any]:
    return response_header("cmpl", "text_completion", model)


def _usage(prepared: PreparedRequest, num_output_tokens: int,
           num_cached_tokens: int) -> dict[str, Any]:
    return usage(sum(len(ids) for ids in prepared.prompt_token_ids), num_output_tokens,
                 num_cached_tokens)


async def completion(state: ServerState, request: CompletionRequest, model: str,
                     ) -> dict[str, Any]:
    prepared = await asyncio.to_thread(prepare_completion, state, request)
    group = await state.bridge.submit(prepared.prompt_token_ids, prepared.params, request.n,
                                      "cmpl")
    results = await collect(group, len(prepared.prompt_token_ids), request.n)
    echoes = _echo_texts(state, request, prepared)
    choices = []
    for p, result in enumerate(results):
        for choice in result.choices:
            logprobs = None
            if request.logprobs is not None:
                logprobs = ChoiceLogprobs(state, request, prepared)
                if request.echo:
                    logprobs.add_prompt(prepared.prompt_token_ids[p], result.prompt_logprobs)
                logprobs.add(choice.token_ids, choice.logprobs, choice.finish_reason)
            choices.append({"index": p * request.n + choice.index,
                            "text": echoes[p] + choice.text,
                            "logprobs": None if logprobs is None else logprobs.data.data,
                            "finish_reason": choice.finish_reason})
    num_output = sum(len(c.token_ids) for r in results for c in r.choices)
    num_cached = sum(r.choices[0].num_cached_tokens for r in results)
    return {**_header(model), "choices": choices,
            "usage": _usage(prepared, num_output, num_cached)}


class CompletionStream:
    """Chunks of a streamed completion. With `logprobs`, a chunk carries the entries of the
    tokens whose text it holds (an incomplete UTF-8 character's tokens wait for the chunk that
    completes it), and an echo goes out with the first delta, beside its prompt logprobs."""

    def __init__(self, state: ServerState, request: CompletionRequest,
                 prepared: PreparedRequest, model: str) -> None:
        self.request, self.prepared = request, prepared
        self.header = _header(model)
        self.echoes = _echo_texts(state, request, prepared)
        num_choices = len(prepared.prompt_token_ids) * request.n
        self.logprobs = [ChoiceLogprobs(state, request, prepared) for _ in range(num_choices)]
        self.has_started = [False] * num_choices
        self.num_output_tokens = 0
        self.num_cached_tokens = [0] * len(prepared.prompt_token_ids)

    @property
    def echoes_upfront(self) -> bool:
        return self.request.echo and self.request.logprobs is None

    def chunk(self, index: int, text: str, logprobs: Any = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return stream_chunk(self.header, choice, self.request.include_usage)

    def first_chunks(self) -> list[dict[str, Any]]:
        if not self.echoes_upfront:
            return []
        n = self.request.n
        return [self.chunk(p * n + i, echo) for p, echo in enumerate(self.echoes) if echo
                for i in range(n)]

    def on_delta(self, prompt_index: int, delta: StreamDelta) -> dict[str, Any] | None:
        index = prompt_index * self.request.n + delta.index
        self.num_output_tokens += len(delta.token_ids)
        if delta.index == 0:
            self.num_cached_tokens[prompt_index] = delta.num_cached_tokens
        text = delta.text
        if self.request.echo and not self.echoes_upfront and not self.has_started[index]:
            text = self.echoes[prompt_index] + text
            self.logprobs[index].add_prompt(self.prepared.prompt_token_ids[prompt_index],
                                            delta.prompt_logprobs)
        self.has_started[index] = True
        if self.request.logprobs is not None:
            self.logprobs[index].add(delta.token_ids, delta.logprobs, delta.finish_reason)
        if not text and delta.finish_reason is None:
            return None
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self.logprobs[index].take_unsent()
        return self.chunk(index, text, logprobs, delta.finish_reason)

    def usage_chunk(self) -> dict[str, Any]:
        return usage_chunk(self.header, _usage(self.prepared, self.num_output_tokens,
                                               sum(self.num_cached_tokens)))


async def completion_stream(state: ServerState, request: CompletionRequest, model: str,
                            ) -> tuple[AsyncIterator[dict[str, Any]], RequestGroup]:
    """Submits before returning; returns the chunk iterator and the request group."""
    prepared = await asyncio.to_thread(prepare_completion, state, request)
    group = await state.bridge.submit(prepared.prompt_token_ids, prepared.params, request.n,
                                      "cmpl")
    stream = CompletionStream(state, request, prepared, model)

    async def events() -> AsyncIterator[dict[str, Any]]:
        async with group:
            for chunk in stream.first_chunks():
                yield chunk
            async for prompt_index, delta in group:
                chunk = stream.on_delta(prompt_index, delta)
                if chunk is not None:
                    yield chunk
        if request.include_usage:
            yield stream.usage_chunk()

    return events(), group
