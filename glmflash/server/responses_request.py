"""/v1/responses requests, validated from JSON and turned into a chat request.

Function tools are rendered through the chat template and parsed by glm47; `reasoning.effort`
becomes the template's `reasoning_effort`; `max_output_tokens`, `temperature` and `top_p` are
the sampling options. Hosted tools (web search, file search, ...), background mode and
conversation objects are not served (a 400 naming the field). Other fields OpenAI defines are
ignored (logged at DEBUG), as on the chat endpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from glmflash.server.fields import Fields
from glmflash.server.messages import parse_messages, parse_tool_choice, parse_tools
from glmflash.server.protocol import REASONING_EFFORTS, ChatCompletionRequest
from glmflash.server.responses_items import items_to_messages, normalize_input

logger = logging.getLogger(__name__)

_FIELDS = {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
           "reasoning", "previous_response_id", "max_output_tokens", "temperature", "top_p",
           "stream", "store", "metadata", "user", "text", "truncation", "background",
           "conversation", "include", "service_tier", "prompt_cache_key", "safety_identifier"}
_UNSERVED = ("background", "conversation")


@dataclass
class ResponsesRequest:
    model: str | None
    input_items: list[dict[str, Any]]
    """This request's input, as items (a string input is one user message)."""
    instructions: str | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    """Function tools in the Responses shape (`{"type": "function", "name", ...}`)."""
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)
    user: str | None = None
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})


def parse_responses_request(raw: Any) -> ResponsesRequest:
    body = Fields(raw)
    ignored = sorted(set(body.raw) - _FIELDS)
    if ignored:
        logger.debug("ignoring request fields %s", ignored)
    for name in _UNSERVED:
        if body.raw.get(name):
            raise body.fail(name, "is not supported by this server")
    if body.raw.get("input") is None:
        raise body.fail("input", "is required")
    reasoning = body.object("reasoning")
    metadata = body.object("metadata")
    return ResponsesRequest(
        model=body.string("model"), input_items=normalize_input(body.raw["input"]),
        instructions=body.string("instructions"), tools=_tools(body),
        tool_choice=body.raw.get("tool_choice") or ("auto" if body.raw.get("tools") else "none"),
        parallel_tool_calls=body.boolean("parallel_tool_calls", True),
        reasoning_effort=None if reasoning is None else
        reasoning.string("effort", choices=REASONING_EFFORTS),
        previous_response_id=body.string("previous_response_id"),
        max_output_tokens=body.integer("max_output_tokens", lo=1),
        temperature=body.number("temperature", lo=0, hi=2),
        top_p=body.number("top_p", lo=0, hi=1), stream=body.boolean("stream"),
        store=body.boolean("store", True), metadata={} if metadata is None else metadata.raw,
        user=body.string("user"), text_format=_text_format(body))


def _tools(body: Fields) -> list[dict[str, Any]]:
    tools = body.array("tools", [])
    for i, raw in enumerate(tools):
        tool = Fields(raw, f"tools[{i}].")
        kind = tool.string("type", required=True)
        if kind != "function":
            raise tool.fail("type", f"{kind!r} tools are not supported (only function tools)")
        tool.string("name", required=True)
        tool.object("parameters")
    return tools


def _text_format(body: Fields) -> dict[str, Any]:
    text = body.object("text")
    fmt = None if text is None else text.object("format")
    if fmt is None:
        return {"type": "text"}
    fmt.string("type", required=True, choices=("text", "json_object", "json_schema"))
    return fmt.raw


def to_chat_request(request: ResponsesRequest, history: list[dict[str, Any]],
                    *, supports_media: bool) -> ChatCompletionRequest:
    """The chat request that renders `history` (earlier turns' items) plus this input."""
    messages = items_to_messages(history + request.input_items, request.instructions)
    chat = ChatCompletionRequest(model=request.model, max_tokens=request.max_output_tokens,
                                 temperature=request.temperature, top_p=request.top_p)
    chat.messages, chat.media = parse_messages(messages, supports_media=supports_media)
    chat.tools = parse_tools([_chat_tool(t) for t in request.tools])
    chat.tool_choice = parse_tool_choice(_chat_tool_choice(request.tool_choice), chat.tools)
    chat.parallel_tool_calls = request.parallel_tool_calls
    chat.response_format = request.text_format["type"]
    if request.reasoning_effort is not None:
        chat.template_kwargs["reasoning_effort"] = request.reasoning_effort
    return chat


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    """`{"type": "function", "name": ...}` is the chat shape's `{"function": {"name": ...}}`."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice
