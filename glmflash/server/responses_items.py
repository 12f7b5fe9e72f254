"""Responses API items and their chat-message equivalents.

Input items (`message`, `reasoning`, `function_call`, `function_call_output`) become the chat
messages the template renders: consecutive reasoning, assistant text and function calls form one
assistant message (`reasoning_content`, `content`, `tool_calls`), a function call output becomes
a `tool` message. Output items are built from the glm45/glm47 parsers' split of the generation.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from glmflash.server.fields import Fields

_INPUT_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_input(raw: Any) -> list[dict[str, Any]]:
    """`input` as a list of items (a string is one user message), each checked."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise Fields({}).fail("input", "must be a string or an array of input items")
    if not raw:
        raise Fields({}).fail("input", "must not be empty")
    return [_check_item(Fields(item, f"input[{i}]."), i) for i, item in enumerate(raw)]


def _check_item(item: Fields, index: int) -> dict[str, Any]:
    kind = item.string("type", "message")
    if kind == "message":
        role = item.string("role", required=True, choices=_INPUT_ROLES)
        content = item.get("content", (str, list), "a string or an array of content parts",
                           required=True)
        if isinstance(content, list):
            for j, part in enumerate(content):
                _check_part(Fields(part, f"{item.param('content')}[{j}]."),
                            images=role == "user")
    elif kind == "function_call":
        item.string("call_id", required=True)
        item.string("name", required=True)
        try:
            json.loads(item.string("arguments", required=True))
        except json.JSONDecodeError as exc:
            raise item.fail("arguments", f"must be a JSON text ({exc.msg})") from None
        except RecursionError:
            raise item.fail("arguments", "must be a JSON text (nested too deeply)") from None
    elif kind == "function_call_output":
        item.string("call_id", required=True)
        output = item.get("output", (str, list), "a string or an array of content parts",
                          required=True)
        for j, part in enumerate(output if isinstance(output, list) else []):
            _check_part(Fields(part, f"{item.param('output')}[{j}]."))
    elif kind == "reasoning":
        for name in ("summary", "content"):
            for j, part in enumerate(item.array(name, [])):
                _check_part(Fields(part, f"{item.param(name)}[{j}]."))
    else:
        raise item.fail("type", f"{kind!r} items are not supported (supported: message, "
                        "function_call, function_call_output, reasoning)")
    return {**item.raw, "type": kind}


def _check_part(part: Fields, images: bool = False) -> None:
    """A content part; images only where the prompt takes them (a user message's content), as
    the chat endpoint does: elsewhere only text is rendered."""
    kind = part.string("type", required=True)
    if kind in _TEXT_PARTS:
        part.string("text", required=True)
    elif kind == "input_image" and images:
        part.string("image_url", required=True)
    elif kind == "input_image":
        raise part.fail("type", "images are only taken in user messages")
    else:
        raise part.fail("type", f"{kind!r} content parts are not supported")


def _text_of(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] in _TEXT_PARTS)


def _user_content(content: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    return [{"type": "image_url", "image_url": {"url": p["image_url"]}}
            if p["type"] == "input_image" else {"type": "text", "text": p["text"]}
            for p in content]


def items_to_messages(items: list[dict[str, Any]],
                      instructions: str | None) -> list[dict[str, Any]]:
    """Chat messages for the template, `instructions` first as a system message."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    turn: dict[str, Any] | None = None
    for item in items:
        kind = item["type"]
        if kind in ("reasoning", "function_call") or kind == "message" and \
                item["role"] == "assistant":
            turn = _add_to_turn(messages, turn, item)
            continue
        turn = None
        if kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text_of(item["output"])})
        elif item["role"] == "user":
            messages.append({"role": "user", "content": _user_content(item["content"])})
        else:
            messages.append({"role": "system", "content": _text_of(item["content"])})
    return messages


def _add_to_turn(messages: list[dict[str, Any]], turn: dict[str, Any] | None,
                 item: dict[str, Any]) -> dict[str, Any]:
    """Fold an assistant-side item into the open assistant message, or open a new one when the
    item cannot follow what it holds (reasoning comes first, calls last)."""
    kind = item["type"]
    is_late = turn is not None and (
        kind == "reasoning" and (turn["content"] or turn.get("tool_calls"))
        or kind == "message" and turn.get("tool_calls"))
    if turn is None or is_late:
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        turn["reasoning_content"] = _text_of(parts)
    elif kind == "message":
        turn["content"] += _text_of(item["content"])
    else:
        turn.setdefault("tool_calls", []).append(
            {"id": item["call_id"], "type": "function",
             "function": {"name": item["name"], "arguments": item["arguments"]}})
    return turn


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [output_text_part(text)]}


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
