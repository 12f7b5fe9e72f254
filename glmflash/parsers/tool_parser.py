"""glm47 tool-call parsing (one-shot) and the combined reasoning + tool output parser.

This module is the public entry point for the engine's `chat()` and the server:

* `parse_tool_calls(text, tools)` -> `ParsedOutput(content, tool_calls)`;
* `ToolCallStreamParser(tools)` (from tool_stream.py) for SSE;
* `ChatOutputParser(tools, reasoning=..., starts_in_reasoning=...)`: glm45 reasoning split, then
  glm47 tool calls, streaming (`feed` / `finish`) or one-shot (`parse`).

Only text before the first `<tool_call>` is content; text between or after call blocks (e.g. a
stray `</think>` or `<|observation|>`) is discarded, as in vLLM and SGLang. Empty or
whitespace-only `content` / `reasoning_content` are None. See tool_format.py for the grammar,
unknown names (dropped) and truncation, and tool_schema.py for value typing.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmflash.parsers.reasoning_parser import ReasoningDelta, ReasoningParser, split_reasoning
from glmflash.parsers.tags import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    WhitespaceGate,
    none_if_blank,
)
from glmflash.parsers.tool_format import (
    TERMINATORS,
    CallState,
    ToolCall,
    new_tool_call_id,
    resolve_key,
    split_key_value,
    split_name_region,
)
from glmflash.parsers.tool_schema import ToolRegistry
from glmflash.parsers.tool_stream import StreamEvent, ToolCallStreamParser

__all__ = [
    "ChatDelta",
    "ChatMessageParse",
    "ChatOutputParser",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallStreamParser",
    "parse_tool_calls",
]

logger = logging.getLogger(__name__)

_ARG_TAG_RE = re.compile(f"({ARG_KEY_START}|{ARG_KEY_END}|{ARG_VALUE_START}|{ARG_VALUE_END})")
_NAME_ENDS = (ARG_KEY_START, ARG_VALUE_START)
Tools = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    """Text before the first `<tool_call>`; None when empty or whitespace-only."""
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, tools: Tools | None) -> ParsedOutput:
    """Parse a complete generation (after reasoning). `tools=None` accepts any function name."""
    registry = ToolRegistry(tools)
    start = text.find(TOOL_CALL_START)
    content = none_if_blank(text if start < 0 else text[:start])
    calls: list[ToolCall] = []
    while start >= 0:
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        body = text[body_start:] if end < 0 else text[body_start:end]
        call = _parse_call(body, registry, is_closed=end >= 0)
        if call is not None:
            calls.append(call)
        start = -1 if end < 0 else text.find(TOOL_CALL_START, end + len(TOOL_CALL_END))
    return ParsedOutput(content, calls)


def _parse_call(body: str, registry: ToolRegistry, *, is_closed: bool) -> ToolCall | None:
    pieces = _ARG_TAG_RE.split(body)
    # Odd positions of `pieces` are tags; the name ends at the first argument opener.
    name_end = next((i for i in range(1, len(pieces), 2) if pieces[i] in _NAME_ENDS), None)
    if name_end is None and not is_closed:
        logger.debug("dropping a tool call truncated inside its name: %r", body)
        return None
    name, arguments = split_name_region("".join(pieces[:name_end]))
    if not registry.is_known(name):
        logger.warning("dropping a call to unknown tool %r", name)
        return None
    if name_end is not None:
        tokens = [(i % 2 == 1, piece) for i, piece in enumerate(pieces)][name_end:]
        _read_pairs(tokens, name, registry, arguments)
    return ToolCall(new_tool_call_id(), name, json.dumps(arguments, ensure_ascii=False))


def _read_pairs(
    tokens: list[tuple[bool, str]], name: str, registry: ToolRegistry, arguments: dict[str, Any]
) -> None:
    """Add the key/value pairs of one call body (after its name) to `arguments`, in order."""
    state, text = CallState.ARGS, ""
    pending: str | None = None
    key: str | None = None
    for is_tag, piece in tokens:
        if not is_tag or piece not in TERMINATORS[state]:
            text += piece
            continue
        if state is CallState.KEY:
            pending, state = text, CallState.AFTER_KEY
        if state is CallState.VALUE:
            _store(arguments, key, text, name, registry)
            state = CallState.ARGS
        elif piece == ARG_VALUE_START:
            key = resolve_key(registry, name, pending, arguments)
            pending, state = None, CallState.VALUE
        elif piece == ARG_KEY_START:
            _store_key_value(arguments, pending, name, registry)
            pending, state = None, CallState.KEY
        text = ""
    if state is CallState.KEY:
        pending = text
    if state is CallState.VALUE:
        _store(arguments, key, text, name, registry)
    _store_key_value(arguments, pending, name, registry)


def _store(
    arguments: dict[str, Any], key: str | None, raw: str, name: str, registry: ToolRegistry
) -> None:
    if key is not None and key not in arguments:
        arguments[key] = registry.coerce(name, key, raw)


def _store_key_value(
    arguments: dict[str, Any], key_text: str | None, name: str, registry: ToolRegistry
) -> None:
    pair = split_key_value(key_text)
    if pair is not None:
        _store(arguments, resolve_key(registry, name, pair[0], arguments), pair[1], name, registry)


@dataclass(slots=True)
class ChatDelta:
    """One streamed piece of the assistant message; exactly one field is set."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """A one-entry list holding an OpenAI streaming tool-call delta."""


@dataclass(slots=True)
class ChatMessageParse:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall]
    finish_reason_hint: str | None
    """`tool_calls` when calls were parsed, else None (keep the engine's stop/length reason;
    the server should also keep `length` when generation was truncated)."""


class ChatOutputParser:
    """glm45 reasoning split chained into glm47 tool parsing, for one choice.

    `tools=None` turns tool parsing off (content passes through, e.g. tool_choice "none");
    `reasoning=False` treats all text as content; `starts_in_reasoning=False` is for a prompt
    prefill that already closed `</think>`.
    """

    def __init__(
        self, tools: Tools | None, *, reasoning: bool = True, starts_in_reasoning: bool = True
    ) -> None:
        self._tools = tools
        self._use_reasoning = reasoning
        self._starts_in_reasoning = starts_in_reasoning
        self._reasoning: ReasoningParser | None = None
        if reasoning:
            self._reasoning = ReasoningParser(starts_in_reasoning=starts_in_reasoning)
        self._tool_stream = ToolCallStreamParser(tools) if tools is not None else None
        self._reasoning_gate = WhitespaceGate()
        self._content_gate = WhitespaceGate()

    @property
    def finish_reason_hint(self) -> str | None:
        """`tool_calls` once at least one call has been streamed, else None."""
        has_calls = self._tool_stream is not None and self._tool_stream.num_tool_calls > 0
        return "tool_calls" if has_calls else None

    def feed(self, delta_text: str) -> list[ChatDelta]:
        if self._reasoning is None:
            return self._route(ReasoningDelta(content=delta_text), is_final=False)
        return self._route(self._reasoning.feed(delta_text), is_final=False)

    def finish(self) -> list[ChatDelta]:
        """End of generation: flush held-back text; calling it again returns []."""
        split = self._reasoning.finish() if self._reasoning is not None else ReasoningDelta()
        return self._route(split, is_final=True)

    def parse(self, text: str) -> ChatMessageParse:
        """One-shot parse of a complete generation; independent of any streaming state."""
        reasoning, rest = "", text
        if self._use_reasoning:
            reasoning, rest = split_reasoning(text, starts_in_reasoning=self._starts_in_reasoning)
        content, calls = none_if_blank(rest), []
        if self._tools is not None:
            parsed = parse_tool_calls(rest, self._tools)
            content, calls = parsed.content, parsed.tool_calls
        hint = "tool_calls" if calls else None
        return ChatMessageParse(none_if_blank(reasoning), content, calls, hint)

    def _route(self, split: ReasoningDelta, *, is_final: bool) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        reasoning = self._reasoning_gate.push(split.reasoning)
        if reasoning:
            out.append(ChatDelta(reasoning_content=reasoning))
        for event in self._content_events(split.content, is_final):
            if event.tool_call is not None:
                out.append(ChatDelta(tool_calls=[event.tool_call]))
            elif out and out[-1].content is not None:
                out[-1].content += event.content or ""
            else:
                out.append(ChatDelta(content=event.content))
        return out

    def _content_events(self, text: str, is_final: bool) -> list[StreamEvent]:
        if self._tool_stream is None:
            released = self._content_gate.push(text)
            return [StreamEvent(content=released)] if released else []
        events = self._tool_stream.feed(text)
        return events + self._tool_stream.finish() if is_final else events
