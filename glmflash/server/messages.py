"""Chat request pieces: messages and their content parts, tools, tool_choice.

Messages are checked here and handed to the chat template as the client sent them (the tokenizer
maps developer -> system, content null -> "", JSON-string arguments -> objects).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from glmflash.server.errors import bad_request
from glmflash.server.fields import Fields

ROLES = ("system", "developer", "user", "assistant", "tool")
_TEXT_PARTS = {"text"}
_PART_TYPES = {
    "system": _TEXT_PARTS, "developer": _TEXT_PARTS, "assistant": _TEXT_PARTS | {"refusal"},
    "user": _TEXT_PARTS | {"image_url", "video_url"}, "tool": _TEXT_PARTS | {"tool_reference"},
}
_MEDIA_NOUNS = {"image_url": "image", "video_url": "video"}
_KEPT_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id", "reasoning_content")


@dataclass(frozen=True)
class ToolChoice:
    mode: str = "none"
    """none, auto, required or function."""
    name: str | None = None
    """The forced function's name when mode is `function`."""

    @property
    def uses_tools(self) -> bool:
        return self.mode != "none"


def parse_messages(raw: list, *, supports_media: bool) -> tuple[list[dict], list[dict]]:
    """Validated messages for the template, and the media parts they carry, in order."""
    if not raw:
        raise bad_request("'messages' must hold at least one message", param="messages")
    media: list[dict] = []
    messages = [_message(Fields(m, f"messages[{i}]."), media, supports_media)
                for i, m in enumerate(raw)]
    return messages, media


def _message(msg: Fields, media: list[dict], supports_media: bool) -> dict[str, Any]:
    role = msg.string("role", required=True, choices=ROLES)
    msg.string("name")
    _content(msg, role, media, supports_media)
    if role == "assistant":
        msg.get("reasoning_content", (str,), "a string")
        msg.get("reasoning", (str,), "a string")
        _tool_calls(msg)
    if role == "tool":
        msg.string("tool_call_id", required=True)
    out = {k: msg.raw[k] for k in _KEPT_KEYS if msg.raw.get(k) is not None}
    if role == "assistant" and "reasoning_content" not in out and msg.has("reasoning"):
        out["reasoning_content"] = msg.raw["reasoning"]
    out.setdefault("content", None if role == "assistant" else "")
    return out


def _content(msg: Fields, role: str, media: list[dict], supports_media: bool) -> None:
    content = msg.get("content", (str, list), "a string or an array of content parts",
                      required=role in ("system", "developer", "user", "tool"))
    if not isinstance(content, list):
        return
    for j, raw_part in enumerate(content):
        part = Fields(raw_part, f"{msg.param('content')}[{j}].")
        kind = part.string("type", required=True)
        if kind not in _PART_TYPES[role]:
            raise part.fail("type", f"{kind!r} is not a supported content part for a {role} "
                            f"message (supported: {sorted(_PART_TYPES[role])})")
        if kind in ("text", "refusal"):
            part.string(kind, required=True)
        elif kind in _MEDIA_NOUNS:
            media.append(route_media_part(part, kind, supports_media=supports_media))


def route_media_part(part: Fields, kind: str, *, supports_media: bool) -> dict[str, Any]:
    """The one gate for image_url / video_url parts: 400 unless the engine can take media."""
    noun = _MEDIA_NOUNS[kind]
    if not supports_media:
        raise bad_request(f"{noun} input is not supported by this server build",
                          param=part.param("type"), code="unsupported_content")
    source = part.object(kind, required=True)
    return {"type": noun, "url": source.string("url", required=True)}


def _tool_calls(msg: Fields) -> None:
    for k, raw_call in enumerate(msg.array("tool_calls", [])):
        call = Fields(raw_call, f"{msg.param('tool_calls')}[{k}].")
        call.string("id", required=True)
        call.string("type", "function", choices=("function",))
        fn = call.object("function", required=True)
        fn.string("name", required=True)
        arguments = fn.get("arguments", (str, dict), "a JSON string or an object", "{}")
        if isinstance(arguments, str) and arguments.strip():
            _check_json_object(fn, arguments)


def _check_json_object(fn: Fields, arguments: str) -> None:
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError) as exc:  # nesting past the parser's stack
        raise fn.fail("arguments", f"is not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise fn.fail("arguments", "must encode a JSON object")


def parse_tools(raw: list | None) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    names: set[str] = set()
    for i, raw_tool in enumerate(raw):
        tool = Fields(raw_tool, f"tools[{i}].")
        tool.string("type", required=True, choices=("function",))
        fn = tool.object("function", required=True)
        name = fn.string("name", required=True)
        if not name.strip() or "<" in name or name in names:
            raise fn.fail("name", f"must be a unique non-empty name without '<', got {name!r}")
        names.add(name)
        fn.string("description")
        fn.object("parameters")
        fn.boolean("strict")
    return raw


def parse_tool_choice(raw: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI's default: `auto` with tools, `none` without."""
    if raw is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(raw, str):
        if raw not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be none, auto, required or a function object, "
                              f"got {raw!r}", param="tool_choice")
        if raw != "none" and not tools:
            raise bad_request(f"'tool_choice' {raw!r} needs 'tools'", param="tool_choice")
        return ToolChoice(raw)
    choice = Fields(raw, "tool_choice.")
    choice.string("type", required=True, choices=("function",))
    name = choice.object("function", required=True).string("name", required=True)
    known = [t["function"]["name"] for t in tools or []]
    if name not in known:
        raise bad_request(f"'tool_choice' names function {name!r}, which is not in 'tools'",
                          param="tool_choice")
    return ToolChoice("function", name)
