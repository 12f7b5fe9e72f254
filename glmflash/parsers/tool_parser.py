"""glm47 tool-call parsing (one-shot) and the combined reasoning + tool output parser.

This module is the public entry point for the engine's `chat()` and the server:

* `parse_tool_calls(text, tools)` -> `ParsedOutput(content, tool_calls)`: the whole text fed
  to the streaming parser and finished, so the glm47 grammar is written once (tool_stream.py);
* `ToolCallStreamParser(tools)` (from tool_stream.py) for SSE;
* `finish_reason(engine_reason, has_tool_calls)`: the one rule for a chat choice's reason;
* `ChatOutputParser(tools, reasoning=..., starts_in_reasoning=...)`: glm45 reasoning split, then
  glm47 tool calls, streaming (`feed` / `finish`) or one-shot (`parse`).

Only text before the first `<tool_call>` is content; text between or after call blocks (e.g. a
stray `</think>` or `<|observation|>`) is discarded, as in vLLM and SGLang. Empty or
whitespace-only `content` / `reasoning_content` are None. See tool_format.py for the grammar,
unknown names (dropped) and truncation, and tool_schema.py for value typing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from glmflash.parsers.reasoning_parser import ReasoningDelta, ReasoningParser, split_reasoning
from glmflash.parsers.tags import WhitespaceGate, none_if_blank
from glmflash.parsers.tool_format import ToolCall
from glmflash.parsers.tool_stream import StreamEvent, ToolCallStreamParser

__all__ = [
    "ChatDelta",
    "ChatMessageParse",
    "ChatOutputParser",
    "ParsedOutput",
    "StreamEvent",
    "ToolCall",
    "ToolCallStreamParser",
    "finish_reason",
    "parse_tool_calls",
]

logger = logging.getLogger(__name__)

Tools = Sequence[Mapping[str, Any]]


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    """Text before the first `<tool_call>`; None when empty or whitespace-only."""
    tool_calls: list[ToolCall]


def parse_tool_calls(text: str, tools: Tools | None) -> ParsedOutput:
    """Parse a complete generation (after reasoning). `tools=None` accepts any function name.

    The whole text goes through the streaming parser (the one glm47 grammar), whose content
    events and per-call argument fragments are then joined.
    """
    parser = ToolCallStreamParser(tools)
    content, calls = "", []
    for event in parser.feed(text) + parser.finish():
        if event.tool_call is None:
            content += event.content or ""
            continue
        function = event.tool_call["function"]
        if "id" in event.tool_call:
            calls.append([event.tool_call["id"], function["name"], ""])
        else:
            calls[-1][2] += function["arguments"]
    return ParsedOutput(none_if_blank(content), [ToolCall(*call) for call in calls])


def finish_reason(engine_reason: str, has_tool_calls: bool) -> str:
    """The OpenAI finish_reason of a chat choice (the one place it is decided): `tool_calls`
    when calls were parsed and generation stopped normally; `length`, `abort` and `error`
    are kept (a truncated call is still reported as truncated)."""
    return "tool_calls" if has_tool_calls and engine_reason == "stop" else engine_reason


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

    def finish_reason(self, engine_reason: str) -> str:
        return finish_reason(engine_reason, bool(self.tool_calls))


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

    def finish_reason(self, engine_reason: str) -> str:
        """The choice's finish_reason after what was streamed (see `finish_reason`)."""
        return finish_reason(engine_reason, self.finish_reason_hint is not None)

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
