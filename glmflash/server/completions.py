"""/v1/completions: raw prompts (no template, no parsers), streaming or not (spec §4.4).

Choices are numbered prompt-major: choice `p * n + i` is the i-th sample of prompt p.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from glmflash.engine.outputs import StreamDelta
from glmflash.server.async_engine import RequestGroup
from glmflash.server.errors import bad_request
from glmflash.server.logprobs import CompletionLogprobs
from glmflash.server.protocol import CompletionRequest
from glmflash.server.state import PreparedRequest, ServerState
from glmflash.server.streaming import collect


def prepare_completion(state: ServerState, request: CompletionRequest) -> PreparedRequest:
    tokenizer = state.engine.tokenizer
    for prompt in request.prompts:
        if isinstance(prompt, str):
            state.check_prompt_size([prompt], request.max_tokens, "prompt")
    prompts = [p if isinstance(p, list) else tokenizer.encode(p) for p in request.prompts]
    if not all(prompts):
        raise bad_request("'prompt' must not be empty", param="prompt")
    for ids in prompts:
        state.max_tokens_for(len(ids), request.max_tokens, "prompt")
    prepared = PreparedRequest(prompts, state.sampling_params(request, request.max_tokens))
    state.run_hook(request, prepared)
    return prepared


def _echo_texts(state: ServerState, request: CompletionRequest,
                prepared: PreparedRequest) -> list[str]:
    if not request.echo:
        return [""] * len(prepared.prompt_token_ids)
    return [p if isinstance(p, str) else state.engine.tokenizer.decode(ids)
            for p, ids in zip(request.prompts, prepared.prompt_token_ids, strict=True)]


def _header(model: str) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": model, "system_fingerprint": None}


def _usage(prepared: PreparedRequest, num_output_tokens: int,
           num_cached_tokens: int) -> dict[str, Any]:
    num_prompt = sum(len(ids) for ids in prepared.prompt_token_ids)
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


async def completion(state: ServerState, request: CompletionRequest, model: str,
                     ) -> dict[str, Any]:
    prepared = await asyncio.to_thread(prepare_completion, state, request)
    group = state.bridge.submit(prepared.prompt_token_ids, prepared.params, request.n, "cmpl")
    results = await collect(group, len(prepared.prompt_token_ids), request.n)
    echoes = _echo_texts(state, request, prepared)
    choices = []
    for p, result in enumerate(results):
        for choice in result.choices:
            logprobs = None
            if request.logprobs is not None:
                logprobs = CompletionLogprobs(state.token_text, request.logprobs)
                logprobs.add(choice.token_ids, choice.logprobs or [])
            choices.append({"index": p * request.n + choice.index,
                            "text": echoes[p] + choice.text,
                            "logprobs": None if logprobs is None else logprobs.data,
                            "finish_reason": choice.finish_reason})
    num_output = sum(len(c.token_ids) for r in results for c in r.choices)
    num_cached = sum(r.choices[0].num_cached_tokens for r in results)
    return {**_header(model), "choices": choices,
            "usage": _usage(prepared, num_output, num_cached)}


class CompletionStream:
    def __init__(self, state: ServerState, request: CompletionRequest,
                 prepared: PreparedRequest, model: str) -> None:
        self.request, self.prepared = request, prepared
        self.header = _header(model)
        self.echoes = _echo_texts(state, request, prepared)
        num_choices = len(prepared.prompt_token_ids) * request.n
        self.logprobs = [CompletionLogprobs(state.token_text, request.logprobs or 0)
                         for _ in range(num_choices)]
        self.num_output_tokens = 0
        self.num_cached_tokens = [0] * len(prepared.prompt_token_ids)

    def chunk(self, index: int, text: str, logprobs: Any = None,
              finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        out = {**self.header, "choices": [choice]}
        if self.request.include_usage:
            out["usage"] = None
        return out

    def first_chunks(self) -> list[dict[str, Any]]:
        n = self.request.n
        return [self.chunk(p * n + i, echo) for p, echo in enumerate(self.echoes) if echo
                for i in range(n)]

    def on_delta(self, prompt_index: int, delta: StreamDelta) -> dict[str, Any] | None:
        index = prompt_index * self.request.n + delta.index
        self.num_output_tokens += len(delta.token_ids)
        if delta.index == 0:
            self.num_cached_tokens[prompt_index] = delta.num_cached_tokens
        logprobs = None
        if self.request.logprobs is not None and delta.token_ids:
            logprobs = self.logprobs[index].add(delta.token_ids, delta.logprobs or [])
        if not delta.text and logprobs is None and delta.finish_reason is None:
            return None
        return self.chunk(index, delta.text, logprobs, delta.finish_reason)

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.header, "choices": [],
                "usage": _usage(self.prepared, self.num_output_tokens,
                                sum(self.num_cached_tokens))}


async def completion_stream(state: ServerState, request: CompletionRequest, model: str,
                            ) -> tuple[AsyncIterator[dict[str, Any]], RequestGroup]:
    """Submits before returning; returns the chunk iterator and the request group."""
    prepared = await asyncio.to_thread(prepare_completion, state, request)
    group = state.bridge.submit(prepared.prompt_token_ids, prepared.params, request.n, "cmpl")
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
