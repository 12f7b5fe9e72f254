"""/v1/responses through the official openai SDK, every object checked against its types:
text and item inputs, instructions, reasoning items, function tools and their results over
previous_response_id, streamed events, max_output_tokens, the bounded store."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.conftest import MODEL

TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}]
CALL = "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"
ASK_TOOL = "SCRIPT:The user wants weather.</think>Checking." + CALL
TOOL_RESULT = "SCRIPT:Fine.</think>It is sunny in Paris."
EVENTS = TypeAdapter(ResponseStreamEvent)


def _valid(response) -> Response:
    """The SDK parses leniently; validate the raw JSON strictly against its model."""
    return Response.model_validate(response.model_dump(mode="json", by_alias=True,
                                                       exclude_unset=True))


def test_text_input_and_instructions(live, client):
    out = _valid(client.responses.create(model=MODEL, input="SCRIPT:hmm</think>Hello there.",
                                         instructions="Be terse.", max_output_tokens=50,
                                         temperature=0, reasoning={"effort": "low"}))
    assert out.status == "completed" and out.object == "response"
    assert [item.type for item in out.output] == ["reasoning", "message"]
    assert out.output[0].content[0].text == "hmm"
    assert out.output_text == "Hello there."
    assert out.usage.output_tokens_details.reasoning_tokens == \
        len(live.engine.tokenizer.encode("hmm"))
    assert out.reasoning.effort == "low" and out.instructions == "Be terse."
    prompt = live.hook.prepared[-1].prompt_text
    assert "Be terse." in prompt and prompt.index("Be terse.") < prompt.index("SCRIPT:")


def test_tool_call_and_its_result_over_previous_response_id(live, client):
    first = _valid(client.responses.create(model=MODEL, input=ASK_TOOL, tools=TOOLS,
                                           max_output_tokens=200))
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "message", "function_call"]
    call = first.output[2]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.status == "completed"
    second = _valid(client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, max_output_tokens=200,
        input=[{"type": "function_call_output", "call_id": call.call_id,
                "output": TOOL_RESULT}]))
    assert second.output_text == "It is sunny in Paris."
    assert second.previous_response_id == first.id
    messages = live.hook.prepared[-1].prompt_text
    for text in ("SCRIPT:The user wants weather.", "get_weather", TOOL_RESULT):
        assert text in messages


def test_item_input_matches_previous_response_id(live, client):
    """Sending the whole conversation as items renders the same prompt as chaining."""
    first = client.responses.create(model=MODEL, input=ASK_TOOL, tools=TOOLS,
                                    max_output_tokens=200)
    result = {"type": "function_call_output", "call_id": first.output[2].call_id,
              "output": TOOL_RESULT}
    client.responses.create(model=MODEL, previous_response_id=first.id, tools=TOOLS,
                            input=[result], max_output_tokens=5)
    chained = live.hook.prepared[-1].prompt_text
    items = [{"role": "user", "content": [{"type": "input_text", "text": ASK_TOOL}]},
             *[item.model_dump(exclude_none=True) for item in first.output], result]
    client.responses.create(model=MODEL, tools=TOOLS, input=items, max_output_tokens=5)
    assert live.hook.prepared[-1].prompt_text == chained


def test_streamed_events_build_the_same_response(live, client):
    raw = list(client.responses.create(model=MODEL, input=ASK_TOOL, tools=TOOLS,
                                       max_output_tokens=200, stream=True))
    events = [EVENTS.validate_python(e.model_dump(mode="json", exclude_unset=True))
              for e in raw]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert (reasoning, text) == ("The user wants weather.", "Checking.")
    assert json.loads(arguments) == {"city": "Paris"} == json.loads(final.output[2].arguments)
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == done == [item.id for item in final.output]
    # The SDK's own stream helper accumulates the events into the final response.
    with client.responses.stream(model=MODEL, input=ASK_TOOL, tools=TOOLS,
                                 max_output_tokens=200) as stream:
        accumulated = stream.get_final_response()
    assert accumulated.output[1].content[0].text == "Checking."
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == "Checking." and stored.status == "completed"


def test_max_output_tokens_makes_an_incomplete_response(client):
    out = _valid(client.responses.create(model=MODEL, input="PREFIX:</think>abc",
                                         max_output_tokens=3))
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3
    # Scripted, so that a freely sampled stop token cannot end the stream inside two tokens.
    events = list(client.responses.create(model=MODEL, input="PREFIX:</think>abcdef",
                                          max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"


def test_store_retrieve_delete_and_bounds(live, client):
    unstored = client.responses.create(model=MODEL, input="hi", max_output_tokens=1,
                                       store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="hi", previous_response_id=unstored.id)
    stored = client.responses.create(model=MODEL, input="hi", max_output_tokens=1)
    assert client.responses.retrieve(stored.id).id == stored.id
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    store = live.app_state.responses
    assert len(store) <= store.max_responses


def test_store_drops_the_least_recently_used():
    from glmflash.server.responses_store import ResponseStore

    store = ResponseStore(max_responses=2, max_bytes=10_000)
    for name in "abc":
        store.put({"id": name}, [])
        if name == "b":
            store.get("a")
    assert store.get("b") is None and store.get("a") and store.get("c")
    store.put({"id": "big", "x": "y" * 20_000}, [])
    assert len(store) == 1 and store.num_bytes > 10_000


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"},
                {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 5000},
                {"type": "function_call_output", "call_id": "c", "output": "x"}]},
     "input[0].arguments"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "x"}]},
     "tools[0].parameters"),
    ({"input": [{"role": "system", "content": [{"type": "input_image",
                                                "image_url": "data:image/png;base64,AA=="}]},
                {"role": "user", "content": "hi"}]}, "input[0].content[0].type"),
])
def test_invalid_requests_name_the_field(live, body, param):
    response = httpx.post(f"{live.url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
