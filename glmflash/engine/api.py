"""The Engine's public calls on top of `add_request`: offline, streaming, chat and async."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from glmflash.engine.multimodal import MediaSources, collect_media
from glmflash.engine.outputs import Result, ResultCollector, StreamDelta
from glmflash.parsers.tool_parser import ChatOutputParser, ToolCall
from glmflash.sampling_params import SamplingParams

if TYPE_CHECKING:
    from glmflash.tokenizer import Tokenizer


@dataclass
class ChatResult:
    text: str
    """The raw generated text (reasoning, content and tool-call markup)."""
    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    result: Result


class EngineApiMixin:
    tokenizer: Tokenizer
    options: Any

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 prompt_token_ids: list[int] | list[list[int]] | None = None,
                 n: int = 1, media: list[MediaSources | None] | None = None) -> list[Result]:
        """Generate for every prompt (text, or token ids); results in prompt order.

        `media` gives each prompt's image / video sources (or None), see `add_request`.
        """
        token_lists = self._prompt_token_lists(prompts, prompt_token_ids)
        if not token_lists:
            return []
        media = media or [None] * len(token_lists)
        if len(media) != len(token_lists):
            raise ValueError(f"media has {len(media)} entries for {len(token_lists)} prompts")
        params = _per_prompt(sampling_params, len(token_lists))
        collectors, done, lock = [], threading.Event(), threading.Lock()
        remaining = [len(token_lists)]

        def make_sink(collector: ResultCollector):
            def sink(delta: StreamDelta) -> None:
                collector.add(delta)
                if delta.finish_reason and collector.is_done:
                    with lock:
                        remaining[0] -= 1
                        if remaining[0] == 0:
                            done.set()
            return sink

        for ids, sources in zip(token_lists, media, strict=True):
            if not sources:
                self._validate_prompt(ids)
        try:
            for ids, p, sources in zip(token_lists, params, media, strict=True):
                collector = ResultCollector("", ids, n)
                collector.request_id = self.add_request(
                    ids, _recording_prompt(collector, p) if sources else p,
                    make_sink(collector), n=n, media=sources or None)
                collectors.append(collector)
        except BaseException:
            # A prompt refused (overloaded, bad media, ...): none of the call's prompts runs.
            for collector in collectors:
                self.abort(collector.request_id)
            raise
        while not done.is_set():
            if self.options.background_loop:
                done.wait()
            else:
                # A failed step ends the requests it ran (as on the engine thread), not the
                # caller's later calls.
                self._guarded_step()
        errors = [c.error for c in collectors if c.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        return [c.result() for c in collectors]

    def stream(self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
               prompt_token_ids: list[int] | None = None, request_id: str | None = None,
               n: int = 1) -> Iterator[StreamDelta]:
        """Yield StreamDeltas as tokens are produced; leaving the loop early aborts the request."""
        (ids,) = self._prompt_token_lists(prompt, prompt_token_ids)
        deltas: queue.SimpleQueue = queue.SimpleQueue()
        rid = self.add_request(ids, sampling_params or SamplingParams(), deltas.put,
                               request_id=request_id, n=n)
        step = None if self.options.background_loop else self._guarded_step
        yield from _drain(deltas, n, lambda: self.abort(rid), step)

    async def astream(self, prompt: str | None = None,
                      sampling_params: SamplingParams | None = None, *,
                      prompt_token_ids: list[int] | None = None, request_id: str | None = None,
                      n: int = 1) -> AsyncIterator[StreamDelta]:
        """Async StreamDeltas; cancelling the consumer aborts the request and frees its cache."""
        (ids,) = self._prompt_token_lists(prompt, prompt_token_ids)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        rid = self.add_request(ids, sampling_params or SamplingParams(),
                               lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d),
                               request_id=request_id, n=n)
        finished = 0
        try:
            while finished < n:
                # Without an engine thread the consumer drives the steps, off the event loop
                # (`step` takes turns with other callers); a step's deltas reach the queue
                # before the step's own completion does.
                while not self.options.background_loop and deltas.empty():
                    await asyncio.to_thread(self._guarded_step)
                delta = await deltas.get()
                finished += delta.finish_reason is not None
                yield delta
        finally:
            if finished < n:
                self.abort(rid)

    async def agenerate(self, prompt: str | None = None,
                        sampling_params: SamplingParams | None = None, *,
                        prompt_token_ids: list[int] | None = None, n: int = 1) -> Result:
        (ids,) = self._prompt_token_lists(prompt, prompt_token_ids)
        collector = ResultCollector("", ids, n)
        async for delta in self.astream(prompt_token_ids=ids, sampling_params=sampling_params,
                                        n=n):
            collector.request_id = delta.request_id
            collector.add(delta)
        return collector.result()

    def chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
             sampling_params: SamplingParams | None = None, **template_kwargs) -> ChatResult:
        """Render with the chat template, generate, split reasoning and parse glm47 tool calls."""
        prompt = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                    add_generation_prompt=True, **template_kwargs)
        token_ids = self.tokenizer.encode(prompt)
        params = sampling_params or SamplingParams()
        (result,) = self.generate(prompt_token_ids=[token_ids], sampling_params=params,
                                  media=[collect_media(messages)])
        parsed = ChatOutputParser(tools).parse(result.text)
        return ChatResult(result.text, parsed.content, parsed.reasoning_content,
                          parsed.tool_calls, parsed.finish_reason(result.finish_reason), result)

    def _prompt_token_lists(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            return [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            return [list(prompt_token_ids)]
        return [list(ids) for ids in prompt_token_ids]


def _drain(deltas: queue.SimpleQueue, n: int, abort, step) -> Iterator[StreamDelta]:
    """Yield until n choices finished; `step` drives the engine when it has no thread."""
    finished = 0
    try:
        while finished < n:
            while step is not None and deltas.empty():
                step()
            delta = deltas.get()
            finished += delta.finish_reason is not None
            yield delta
    finally:
        if finished < n:
            abort()


def _recording_prompt(collector: ResultCollector, params: SamplingParams):
    """`params` for add_request that also keeps the final prompt (media expanded) in the
    result."""
    def params_for(prompt_token_ids: list[int]) -> SamplingParams:
        collector.prompt_token_ids = prompt_token_ids
        return params
    return params_for


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
