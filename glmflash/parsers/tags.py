"""GLM special-tag strings and the text helpers both output parsers use to find them in a stream."""

from __future__ import annotations

from collections.abc import Sequence

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
ARG_KEY_START = "<arg_key>"
ARG_KEY_END = "</arg_key>"
ARG_VALUE_START = "<arg_value>"
ARG_VALUE_END = "</arg_value>"


def find_first_tag(text: str, tags: Sequence[str]) -> tuple[int, str] | None:
    """Position and text of the earliest occurrence of any of `tags` in `text`, or None."""
    best: tuple[int, str] | None = None
    for tag in tags:
        pos = text.find(tag)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, tag)
    return best


def partial_tag_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags`.

    A streaming parser holds that suffix back: the next delta may complete the tag.
    """
    max_len = max(len(tag) for tag in tags) - 1
    for start in range(max(0, len(text) - max_len), len(text)):
        if text[start] != "<":
            continue
        tail = text[start:]
        if any(tag.startswith(tail) and tag != tail for tag in tags):
            return len(text) - start
    return 0


def none_if_blank(text: str) -> str | None:
    """The OpenAI convention used here for message fields: empty or whitespace-only means absent."""
    return text if text.strip() else None


class WhitespaceGate:
    """Streams one message field so that it agrees with `none_if_blank` on the whole text.

    NOTE: while everything seen so far is whitespace the text is held back, because a field that
    ends whitespace-only is reported as None and must not have been streamed.
    """

    __slots__ = ("_held", "is_open")

    def __init__(self) -> None:
        self._held = ""
        self.is_open = False

    def push(self, text: str) -> str:
        """Text that may be emitted now (possibly empty)."""
        if self.is_open:
            return text
        self._held += text
        if not self._held.strip():
            return ""
        self.is_open = True
        released, self._held = self._held, ""
        return released
