"""Streaming glm47 tool-call parser: text deltas in, content text and OpenAI tool-call deltas out.

This is the one glm47 grammar: `parse_tool_calls` feeds it a whole text and joins the events.
Invariant (tests/parsers/test_parsers.py checks it under every chunking, against recorded
outputs): the output does not depend on how the text is split into deltas.

Emission rules (spec/chat_api.md §2.3):
* the header `{"index", "id", "type": "function", "function": {"name", "arguments": ""}}` is sent
  once the name is complete (at `<arg_key>`, `<arg_value>` or `</tool_call>`), never a partial name;
* then `{` at once, `"key": "` when a string-typed value opens, its text JSON-escaped as it
  arrives, and `"` when it closes; other values (schema non-string, unions, unknown type) are
  typed and sent as one `"key": value` fragment when they close; `}` closes the call, so a
  zero-argument call streams `{}`;
* a suffix that could still become a tag is held back; `finish()` flushes it and closes an open
  call, so the arguments are always valid JSON.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from glmflash.parsers.tags import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    WhitespaceGate,
    find_first_tag,
    partial_tag_len,
)
from glmflash.parsers.tool_format import (
    TERMINATORS,
    CallState,
    dumps,
    new_tool_call_id,
    resolve_key,
    split_key_value,
    split_name_region,
)
from glmflash.parsers.tool_schema import ToolRegistry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StreamEvent:
    """Exactly one of the two fields is set."""

    content: str | None = None
    """Message content text."""
    tool_call: dict[str, Any] | None = None
    """One OpenAI streaming `delta.tool_calls[]` entry."""


class _ValueMode(enum.Enum):
    SKIP = enum.auto()
    STRING = enum.auto()
    BUFFER = enum.auto()


@dataclass(slots=True)
class _OpenCall:
    name: str
    index: int | None
    """None for a dropped call (unknown name): its body is read but nothing is emitted."""
    seen: set[str] = field(default_factory=set)


class ToolCallStreamParser:
    """Incremental glm47 parser for one choice. `tools=None` accepts any function name."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        self._registry = ToolRegistry(tools)
        self._state = CallState.CONTENT
        self._buf = ""
        # The name or key being read, or the raw text of a buffered value.
        self._text = ""
        self._pending_key: str | None = None
        self._key: str | None = None
        self._mode = _ValueMode.SKIP
        self._call: _OpenCall | None = None
        self._num_calls = 0
        self._content_gate = WhitespaceGate()
        self._events: list[StreamEvent] = []

    @property
    def num_tool_calls(self) -> int:
        """Calls emitted so far (dropped calls are not counted)."""
        return self._num_calls

    def feed(self, delta_text: str) -> list[StreamEvent]:
        self._buf += delta_text
        self._drain(is_final=False)
        return self._take_events()

    def finish(self) -> list[StreamEvent]:
        """End of generation: flush held-back text and close an open call."""
        self._drain(is_final=True)
        if self._state is CallState.NAME:
            logger.debug("dropping a tool call truncated inside its name: %r", self._text)
            self._state = CallState.IDLE
        elif self._state is not CallState.CONTENT and self._state is not CallState.IDLE:
            self._on_tag(TOOL_CALL_END)
        return self._take_events()

    def _drain(self, *, is_final: bool) -> None:
        while self._buf:
            tags = TERMINATORS[self._state]
            hit = find_first_tag(self._buf, tags)
            if hit is None:
                cut = len(self._buf) - (0 if is_final else partial_tag_len(self._buf, tags))
                self._on_text(self._buf[:cut])
                self._buf = self._buf[cut:]
                return
            pos, tag = hit
            self._on_text(self._buf[:pos])
            self._buf = self._buf[pos + len(tag) :]
            self._on_tag(tag)

    def _on_text(self, text: str) -> None:
        if not text:
            return
        state = self._state
        if state is CallState.CONTENT:
            released = self._content_gate.push(text)
            if released:
                self._events.append(StreamEvent(content=released))
        elif state is CallState.NAME or state is CallState.KEY:
            self._text += text
        elif state is CallState.VALUE and self._mode is _ValueMode.STRING:
            self._emit_arguments(dumps(text)[1:-1])
        elif state is CallState.VALUE and self._mode is _ValueMode.BUFFER:
            self._text += text

    def _on_tag(self, tag: str) -> None:
        state = self._state
        if tag == TOOL_CALL_START:
            self._state, self._text = CallState.NAME, ""
        elif state is CallState.NAME:
            self._open_call(self._text)
            self._after_field(tag)
        elif state is CallState.KEY:
            self._pending_key = self._text
            if tag == ARG_KEY_END:
                self._state = CallState.AFTER_KEY
            else:
                self._after_field(tag)
        elif state is CallState.VALUE:
            self._close_value()
            if tag == TOOL_CALL_END:
                self._close_call()
            else:
                self._state = CallState.ARGS
        else:
            self._after_field(tag)

    def _after_field(self, tag: str) -> None:
        """React to a tag that follows the name, a key, or a complete pair."""
        if tag == ARG_VALUE_START:
            key_text, self._pending_key = self._pending_key, None
            self._open_value(key_text)
            return
        self._recover_key_value()
        if tag == ARG_KEY_START:
            self._state, self._text = CallState.KEY, ""
        else:
            self._close_call()

    def _open_call(self, region: str) -> None:
        name, inline = split_name_region(region)
        if not self._registry.is_known(name):
            logger.warning("dropping a call to unknown tool %r", name)
            self._call = _OpenCall(name, None)
            return
        self._call = call = _OpenCall(name, self._num_calls)
        self._num_calls += 1
        function = {"name": name, "arguments": ""}
        header = {"index": call.index, "id": new_tool_call_id(), "type": "function"}
        self._events.append(StreamEvent(tool_call={**header, "function": function}))
        self._emit_arguments("{")
        for key, value in inline.items():
            self._add_pair(key, value)

    def _open_value(self, key_text: str | None) -> None:
        call = self._call
        assert call is not None
        self._state, self._text, self._mode = CallState.VALUE, "", _ValueMode.SKIP
        self._key = None
        if call.index is None:
            return
        self._key = resolve_key(self._registry, call.name, key_text, call.seen)
        if self._key is None:
            logger.debug("dropping a value without a usable key in call %r", call.name)
        elif self._registry.is_string_param(call.name, self._key):
            self._mode = _ValueMode.STRING
            self._emit_arguments(self._separator() + dumps(self._key) + ': "')
            call.seen.add(self._key)
        else:
            self._mode = _ValueMode.BUFFER

    def _close_value(self) -> None:
        if self._mode is _ValueMode.STRING:
            self._emit_arguments('"')
        elif self._mode is _ValueMode.BUFFER:
            assert self._call is not None and self._key is not None
            self._add_pair(self._key, self._registry.coerce(self._call.name, self._key, self._text))
        self._mode, self._key, self._text = _ValueMode.SKIP, None, ""

    def _recover_key_value(self) -> None:
        pair = split_key_value(self._pending_key)
        self._pending_key = None
        call = self._call
        if pair is None or call is None or call.index is None:
            return
        key = resolve_key(self._registry, call.name, pair[0], call.seen)
        if key is not None:
            self._add_pair(key, self._registry.coerce(call.name, key, pair[1]))

    def _add_pair(self, key: str, value: Any) -> None:
        assert self._call is not None
        if key in self._call.seen:
            return
        self._emit_arguments(self._separator() + dumps(key) + ": " + dumps(value))
        self._call.seen.add(key)

    def _close_call(self) -> None:
        self._emit_arguments("}")
        self._call, self._state = None, CallState.IDLE

    def _separator(self) -> str:
        assert self._call is not None
        return ", " if self._call.seen else ""

    def _emit_arguments(self, fragment: str) -> None:
        call = self._call
        if fragment and call is not None and call.index is not None:
            delta = {"index": call.index, "function": {"arguments": fragment}}
            self._events.append(StreamEvent(tool_call=delta))

    def _take_events(self) -> list[StreamEvent]:
        events, self._events = _coalesce(self._events), []
        return events


def _coalesce(events: list[StreamEvent]) -> list[StreamEvent]:
    """Merge adjacent content events and adjacent argument fragments of one call."""
    out: list[StreamEvent] = []
    for event in events:
        prev = out[-1] if out else None
        if prev is not None and prev.content is not None and event.content is not None:
            prev.content += event.content
        elif prev is not None and _same_call_fragments(prev.tool_call, event.tool_call):
            assert prev.tool_call is not None and event.tool_call is not None
            prev.tool_call["function"]["arguments"] += event.tool_call["function"]["arguments"]
        else:
            out.append(event)
    return out


def _same_call_fragments(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Both are argument fragments (not headers) of the same call."""
    if a is None or b is None or "id" in a or "id" in b:
        return False
    return a["index"] == b["index"]
