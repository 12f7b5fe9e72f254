"""/v1/responses (the OpenAI Responses API) on top of the chat path.

A request's items (after those of `previous_response_id`'s conversation) are rendered as chat
messages; the generation is split by the glm45 reasoning parser and the glm47 tool parser into
output items: `reasoning` (its text as `reasoning_text` content), `message` (`output_text`) and
`function_call`. A response ended by `max_output_tokens` is `incomplete`. Responses are stored
(unless `store: false`) in the bounded ResponseStore.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from glmflash.server.async_engine import RequestGroup
from glmflash.server.chat import ChatPlan, keep_tool_call, prepare_chat, submit_chat
from glmflash.server.engine_input import PreparedRequest
from glmflash.server.errors import ApiError
from glmflash.server.responses_items import (
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
)
from glmflash.server.responses_request import ResponsesRequest, to_chat_request
from glmflash.server.state import ServerState
from glmflash.server.streaming import collect


@dataclass
class ResponseContext:
    """One response being made: its request, the conversation before it, its identity."""

    request: ResponsesRequest
    model: str
    history: list[dict[str, Any]]
    plan: ChatPlan
    prepared: PreparedRequest
    response_id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id, "object": "response", "created_at": self.created_at,
            "status": status, "model": self.model, "output": output, "error": None,
            "incomplete_details": incomplete, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "previous_response_id": request.previous_response_id,
            "parallel_tool_calls": request.parallel_tool_calls,
            "reasoning": {"effort": request.reasoning_effort, "summary": None},
            "temperature": request.temperature, "top_p": request.top_p,
            "tool_choice": request.tool_choice, "tools": request.tools,
            "text": {"format": request.text_format}, "truncation": "disabled",
            "metadata": request.metadata, "user": request.user, "store": request.store,
            "background": False, "usage": usage,
        }

    def usage(self, output_token_ids: list[int]) -> dict[str, Any]:
        num_input = len(self.prepared.prompt_token_ids[0])
        num_output = len(output_token_ids)
        return {"input_tokens": num_input,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": num_output,
                "output_tokens_details": {
                    "reasoning_tokens": self.plan.num_reasoning_tokens(output_token_ids)},
                "total_tokens": num_input + num_output}


def response_status(finish_reason: str) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def prepare_response(state: ServerState, request: ResponsesRequest,
                     model: str) -> ResponseContext:
    """Resolve the previous conversation and render the prompt (blocking: off the loop)."""
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        stored = state.responses.get(request.previous_response_id)
        if stored is None:
            raise ApiError(404, f"Previous response with id '{request.previous_response_id}' "
                           "not found.", param="previous_response_id", code="not_found")
        history = stored.conversation
    chat = to_chat_request(request, history, supports_media=state.bridge.supports_media)
    prepared, plan = prepare_chat(state, chat)
    return ResponseContext(request, model, history, plan, prepared)


async def submit(state: ServerState, context: ResponseContext) -> RequestGroup:
    return await submit_chat(state, context.prepared, 1, "resp")


def store_response(state: ServerState, context: ResponseContext,
                   response: dict[str, Any]) -> None:
    if context.request.store:
        conversation = context.history + context.request.input_items + response["output"]
        state.responses.put(response, conversation)


def output_items(plan: ChatPlan, text: str) -> list[dict[str, Any]]:
    parsed = plan.new_parser().parse(text)
    items = []
    if parsed.reasoning_content:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning_content))
    if parsed.content:
        items.append(message_item(new_id("msg"), parsed.content))
    for i, call in enumerate(parsed.tool_calls):
        if keep_tool_call(plan, i):
            items.append(function_call_item(new_id("fc"), call.id, call.name, call.arguments))
    return items


async def create_response(state: ServerState, request: ResponsesRequest,
                          model: str) -> dict[str, Any]:
    context = await asyncio.to_thread(prepare_response, state, request, model)
    (result,) = await collect(await submit(state, context), 1, 1)
    choice = result.choices[0]
    response = context.response(response_status(choice.finish_reason),
                                output_items(context.plan, choice.text),
                                context.usage(choice.token_ids))
    store_response(state, context, response)
    return response
