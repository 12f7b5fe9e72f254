"""glm45 reasoning split (spec/chat_api.md §3): `reasoning_content` vs `content`.

The GLM-5.3-Flash prompt always ends with `<|assistant|><think>`, so generation starts inside the
reasoning block. Rules:

* one leading `<think>` (optionally after whitespace) is stripped if the model repeats it;
* reasoning ends at the first `</think>` (dropped) or, if a `<tool_call>` comes first, at that
  `<tool_call>` (kept: it starts the content that the tool parser reads);
* no end marker by the end of generation: everything is reasoning;
* `starts_in_reasoning=False` (the prompt prefill already closed `</think>`, spec §6.6): all text
  is content, passed through untouched.

The streaming parser never emits part of a tag: a suffix that could still become `</think>` or
`<tool_call>` is held back until the next delta or `finish()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from glmflash.parsers.tags import (
    THINK_END,
    THINK_START,
    TOOL_CALL_START,
    find_first_tag,
    partial_tag_len,
)

_REASONING_ENDS = (THINK_END, TOOL_CALL_START)


class ReasoningSplit(NamedTuple):
    """One-shot result; both fields are raw text ("" when absent)."""

    reasoning: str
    content: str


@dataclass(slots=True)
class ReasoningDelta:
    """Text released by one `feed()` / `finish()` call."""

    reasoning: str = ""
    """New reasoning text, never containing a think tag."""
    content: str = ""
    """New content text (may start with `<tool_call>`, which the tool parser consumes)."""


def split_reasoning(text: str, *, starts_in_reasoning: bool = True) -> ReasoningSplit:
    """Split a complete generation into reasoning and content."""
    if not starts_in_reasoning:
        return ReasoningSplit("", text)
    body = _strip_think_start(text)
    hit = find_first_tag(body, _REASONING_ENDS)
    if hit is None:
        return ReasoningSplit(body, "")
    pos, tag = hit
    content_start = pos + len(THINK_END) if tag == THINK_END else pos
    return ReasoningSplit(body[:pos], body[content_start:])


def _strip_think_start(text: str) -> str:
    stripped = text.lstrip()
    return stripped[len(THINK_START) :] if stripped.startswith(THINK_START) else text


class _Phase(enum.Enum):
    START = enum.auto()
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ReasoningParser:
    """Incremental `split_reasoning`: any chunking of the text gives the same joined result."""

    def __init__(self, *, starts_in_reasoning: bool = True) -> None:
        self._phase = _Phase.START if starts_in_reasoning else _Phase.CONTENT
        self._buf = ""

    @property
    def is_in_reasoning(self) -> bool:
        """True until the reasoning block has ended (or if it never started)."""
        return self._phase is not _Phase.CONTENT

    def feed(self, delta_text: str) -> ReasoningDelta:
        """Consume one text delta; return what can be released without risking a partial tag."""
        self._buf += delta_text
        return self._drain(is_final=False)

    def finish(self) -> ReasoningDelta:
        """Flush everything held back (end of generation)."""
        return self._drain(is_final=True)

    def _drain(self, *, is_final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._phase is _Phase.START and not self._leave_start(is_final):
            return out
        if self._phase is _Phase.REASONING:
            out.reasoning = self._take_reasoning(is_final)
        if self._phase is _Phase.CONTENT:
            out.content, self._buf = self._buf, ""
        return out

    def _leave_start(self, is_final: bool) -> bool:
        """Decide whether the text opens with a repeated `<think>`; False while undecidable."""
        stripped = self._buf.lstrip()
        if not is_final and THINK_START.startswith(stripped):
            return False
        if stripped.startswith(THINK_START):
            self._buf = stripped[len(THINK_START) :]
        self._phase = _Phase.REASONING
        return True

    def _take_reasoning(self, is_final: bool) -> str:
        hit = find_first_tag(self._buf, _REASONING_ENDS)
        if hit is not None:
            pos, tag = hit
            reasoning = self._buf[:pos]
            self._buf = self._buf[pos + len(tag) :] if tag == THINK_END else self._buf[pos:]
            self._phase = _Phase.CONTENT
            return reasoning
        keep = 0 if is_final else partial_tag_len(self._buf, _REASONING_ENDS)
        cut = len(self._buf) - keep
        reasoning, self._buf = self._buf[:cut], self._buf[cut:]
        return reasoning
