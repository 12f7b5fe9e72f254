"""Streaming /v1/responses: the Responses API's typed events.

`response.created` and `response.in_progress`, then per output item `output_item.added`, its
content part (`content_part.added` for reasoning and messages), the deltas
(`reasoning_text.delta`, `output_text.delta`, `function_call_arguments.delta`), the matching
`.done` events and `output_item.done`; last `response.completed` (or `response.incomplete`).
An item opens when the parsers' pieces switch kind (reasoning, text, a new call) and closes when
the next opens or the generation ends. Every event carries a `sequence_number`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from typing import Any

from glmflash.engine.outputs import StreamDelta
from glmflash.parsers.tool_parser import ChatDelta
from glmflash.server.async_engine import RequestGroup
from glmflash.server.chat import keep_tool_call
from glmflash.server.responses import (
    ResponseContext,
    prepare_response,
    response_status,
    store_response,
    submit,
)
from glmflash.server.responses_items import (
    function_call_item,
    message_item,
    new_id,
    output_text_part,
    reasoning_item,
)
from glmflash.server.responses_request import ResponsesRequest
from glmflash.server.state import ServerState


class _OpenItem:
    """The output item being streamed: its kind, id, position and text (or arguments)."""

    def __init__(self, kind: str, output_index: int, call: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.item_id = new_id({"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind])
        self.output_index = output_index
        self.text = ""
        self.call_id = call["id"] if call else ""
        self.name = call["function"]["name"] if call else ""

    def item(self, status: str) -> dict[str, Any]:
        if self.kind == "reasoning":
            return reasoning_item(self.item_id, self.text, status)
        if self.kind == "message":
            return message_item(self.item_id, self.text, status)
        return function_call_item(self.item_id, self.call_id, self.name, self.text, status)

    def part(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            return {"type": "reasoning_text", "text": self.text}
        return output_text_part(self.text)


class ResponsesStream:
    def __init__(self, context: ResponseContext) -> None:
        self.context = context
        self.parser = context.plan.new_parser()
        self.sequence_numbers = itertools.count()
        self.output: list[dict[str, Any]] = []
        self.open: _OpenItem | None = None
        self.token_ids: list[int] = []

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self.sequence_numbers), **fields}

    def start(self) -> list[dict[str, Any]]:
        snapshot = self.context.response("in_progress", [])
        return [self.event("response.created", response=snapshot),
                self.event("response.in_progress", response=snapshot)]

    def on_delta(self, delta: StreamDelta) -> list[dict[str, Any]]:
        self.token_ids += delta.token_ids
        pieces = self.parser.feed(delta.text)
        if delta.finish_reason is not None:
            pieces += self.parser.finish()
        events = [e for piece in pieces for e in self._piece(piece)]
        if delta.finish_reason is None:
            return events
        events += self._close()
        status = response_status(delta.finish_reason)
        response = self.context.response(status, self.output,
                                         self.context.usage(self.token_ids))
        events.append(self.event(f"response.{status}", response=response))
        return events

    def _piece(self, piece: ChatDelta) -> list[dict[str, Any]]:
        if piece.reasoning_content is not None:
            return self._text("reasoning", "response.reasoning_text.delta",
                              piece.reasoning_content)
        if piece.content is not None:
            return self._text("message", "response.output_text.delta", piece.content,
                              logprobs=[])
        events = []
        for call in piece.tool_calls or []:
            if not keep_tool_call(self.context.plan, call["index"]):
                continue
            if "id" in call:
                events += self._close() + self._open("function_call", call)
            arguments = call["function"].get("arguments") or ""
            if arguments and self.open is not None:
                self.open.text += arguments
                events.append(self._delta("response.function_call_arguments.delta", arguments))
        return events

    def _text(self, kind: str, event: str, text: str, **extra: Any) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close() + self._open(kind)
        self.open.text += text
        return events + [self._delta(event, text, content_index=0, **extra)]

    def _delta(self, event: str, text: str, **extra: Any) -> dict[str, Any]:
        return self.event(event, item_id=self.open.item_id, output_index=self.open.output_index,
                          delta=text, **extra)

    def _open(self, kind: str, call: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self.open = item = _OpenItem(kind, len(self.output), call)
        added = item.item("in_progress")
        if kind != "function_call":
            added["content"] = []
        events = [self.event("response.output_item.added", output_index=item.output_index,
                             item=added)]
        if kind != "function_call":
            events.append(self.event("response.content_part.added", item_id=item.item_id,
                                     output_index=item.output_index, content_index=0,
                                     part={**item.part(), "text": ""}))
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.item_id, "output_index": item.output_index}
        if item.kind == "function_call":
            events = [self.event("response.function_call_arguments.done", **where,
                                 arguments=item.text)]
        else:
            done = "response.reasoning_text.done" if item.kind == "reasoning" else \
                "response.output_text.done"
            extra = {"logprobs": []} if item.kind == "message" else {}
            events = [self.event(done, **where, content_index=0, text=item.text, **extra),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=item.part())]
        final = item.item("completed")
        self.output.append(final)
        return events + [self.event("response.output_item.done",
                                    output_index=item.output_index, item=final)]


async def create_response_stream(state: ServerState, request: ResponsesRequest, model: str,
                                 ) -> tuple[AsyncIterator[dict[str, Any]], RequestGroup]:
    """Submits before returning (so errors are plain HTTP errors); returns the events and the
    request group (whose `close` aborts it)."""
    context = await asyncio.to_thread(prepare_response, state, request, model)
    group = await submit(state, context)
    stream = ResponsesStream(context)

    async def events() -> AsyncIterator[dict[str, Any]]:
        for event in stream.start():
            yield event
        async with group:
            async for _, delta in group:
                for event in stream.on_delta(delta):
                    if event["type"] in ("response.completed", "response.incomplete"):
                        store_response(state, context, event["response"])
                    yield event

    return events(), group
