"""glm47 tool-call grammar shared by the one-shot and the streaming parser (spec/chat_api.md §2).

    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>

Whitespace (GLM-4.5 style newlines) between tags is ignored; names and keys are stripped, values
are kept verbatim. Both parsers read a call with the same state table, `TERMINATORS`: in each
state only the listed tags act, any other text (including other tags) is part of the name, key or
value being read, or is ignored between fields.

Semantics both parsers implement (the test suite checks they agree under any chunking):

* calls whose name is not in `tools` are dropped, body and all (vLLM >= 0.24 behaviour, spec §2.2);
* a key repeated within one call keeps its first value;
* the end of the text closes an open call as `</tool_call>` would (values read so far are kept),
  except a call whose name is still being read, which is dropped;
* malformed shapes are recovered where unambiguous (spec §2.4): a value without `<arg_key>` goes
  to the tool's sole parameter, `<arg_key>k=v</arg_key>` with no `<arg_value>` is the pair k, v,
  and a JSON object after the name (`NAME{"k": 1}` or `{"name": ..., "arguments": {...}}`) is
  read as the arguments.
"""

from __future__ import annotations

import enum
import json
import math
import secrets
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from glmflash.parsers.tags import (
    ARG_KEY_END,
    ARG_KEY_START,
    ARG_VALUE_END,
    ARG_VALUE_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
)
from glmflash.parsers.tool_schema import ToolRegistry


class CallState(enum.Enum):
    CONTENT = enum.auto()
    """Before the first `<tool_call>`: text is message content."""
    IDLE = enum.auto()
    """Between or after calls: text is discarded."""
    NAME = enum.auto()
    ARGS = enum.auto()
    """Inside a call, between fields."""
    KEY = enum.auto()
    AFTER_KEY = enum.auto()
    """`</arg_key>` seen, waiting for `<arg_value>`."""
    VALUE = enum.auto()


TERMINATORS: dict[CallState, tuple[str, ...]] = {
    CallState.CONTENT: (TOOL_CALL_START,),
    CallState.IDLE: (TOOL_CALL_START,),
    CallState.NAME: (ARG_KEY_START, ARG_VALUE_START, TOOL_CALL_END),
    CallState.ARGS: (ARG_KEY_START, ARG_VALUE_START, TOOL_CALL_END),
    CallState.KEY: (ARG_KEY_END, ARG_VALUE_START, TOOL_CALL_END),
    CallState.AFTER_KEY: (ARG_VALUE_START, ARG_KEY_START, TOOL_CALL_END),
    CallState.VALUE: (ARG_VALUE_END, TOOL_CALL_END),
}


@dataclass(slots=True)
class ToolCall:
    """One parsed call, in the OpenAI non-streaming shape."""

    id: str
    """`call_` + 24 lowercase hex digits."""
    name: str
    arguments: str
    """JSON object text, `json.dumps(..., ensure_ascii=False)` with default separators."""

    def to_openai(self) -> dict[str, Any]:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


def new_tool_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def dumps(value: Any) -> str:
    """JSON text exactly as `json.dumps(arguments_dict, ensure_ascii=False)` writes a part."""
    return json.dumps(value, ensure_ascii=False)


def split_name_region(region: str) -> tuple[str, dict[str, Any]]:
    """Function name and inline JSON arguments from the text between `<tool_call>` and the
    first argument tag (or `</tool_call>`)."""
    brace = region.find("{")
    inline = _load_object(region[brace:]) if brace >= 0 else None
    if inline is None:
        return region.strip(), {}
    name = region[:brace].strip()
    if name or not isinstance(inline.get("name"), str):
        return name, inline
    arguments = inline.get("arguments", {})
    if isinstance(arguments, str):
        arguments = _load_object(arguments) or {}
    return inline["name"].strip(), arguments if isinstance(arguments, dict) else {}


def _float_or_text(text: str) -> float | str:
    """A JSON number as a float, or its text where it overflows a float: written back as a
    string, never as Infinity, which is not JSON."""
    value = float(text)
    return value if math.isfinite(value) else text


def _load_object(text: str) -> dict[str, Any] | None:
    """The JSON object of `text` or None; NaN and Infinity (which JSON lacks) and numbers past
    a float's range are kept as their text."""
    try:
        value = json.loads(text, parse_constant=str, parse_float=_float_or_text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def resolve_key(
    registry: ToolRegistry, name: str, key_text: str | None, seen: Container[str]
) -> str | None:
    """The key a value is stored under, or None to drop it (no key, or a repeated key)."""
    key = (key_text or "").strip() or registry.sole_param(name) or ""
    return key if key and key not in seen else None


def split_key_value(key_text: str | None) -> tuple[str, str] | None:
    """Recover `<arg_key>k=v</arg_key>` written without an `<arg_value>`."""
    if not key_text or "=" not in key_text:
        return None
    key, value = key_text.split("=", 1)
    return (key.strip(), value.strip()) if key.strip() else None
