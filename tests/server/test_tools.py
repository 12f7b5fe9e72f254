"""Reasoning and glm47 tool calls end to end (scripted model output), tool_choice, and the chat
template against transformers."""

from __future__ import annotations

import json

import pytest
from transformers import PreTrainedTokenizerFast

from tests.server.conftest import MODEL

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
SCRIPT = "SCRIPT:The user wants weather.</think>Let me check." + CALL


def _ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_reasoning_and_tool_calls(live, client):
    out = client.chat.completions.create(model=MODEL, messages=_ask(SCRIPT), tools=TOOLS,
                                         max_tokens=200)
    (choice,) = out.choices
    message = choice.message
    assert message.model_extra["reasoning_content"] == "The user wants weather."
    assert message.content == "Let me check."
    assert choice.finish_reason == "tool_calls"
    (call,) = message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    reasoning_ids = live.engine.tokenizer.encode("The user wants weather.")
    assert out.usage.completion_tokens_details.reasoning_tokens == len(reasoning_ids)


def test_streamed_tool_call_deltas(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=_ask(SCRIPT),
                                                 tools=TOOLS, max_tokens=200, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("The user wants weather.", "Let me check.")
    fragments = [t for d in deltas for t in d.tool_calls or []]
    head, *rest = fragments
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in rest)
    assert json.loads("".join(f.function.arguments for f in rest)) == {"city": "Paris", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls(client, parallel):
    script = "SCRIPT:two calls</think>" + CALL + "<tool_call>get_time</tool_call>"
    out = client.chat.completions.create(model=MODEL, messages=_ask(script), tools=TOOLS,
                                         max_tokens=200, parallel_tool_calls=parallel)
    names = [c.function.name for c in out.choices[0].message.tool_calls]
    assert names == (["get_weather", "get_time"] if parallel else ["get_weather"])
    assert json.loads(out.choices[0].message.tool_calls[-1].function.arguments) == \
        ({} if parallel else {"city": "Paris", "days": 2})
    stream = client.chat.completions.create(model=MODEL, messages=_ask(script), tools=TOOLS,
                                            max_tokens=200, parallel_tool_calls=parallel,
                                            stream=True)
    indices = {t.index for c in stream for t in c.choices[0].delta.tool_calls or []}
    assert indices == ({0, 1} if parallel else {0})


def test_unknown_tool_names_are_dropped(client):
    script = "SCRIPT:x</think><tool_call>launch_rockets</tool_call>"
    out = client.chat.completions.create(model=MODEL, messages=_ask(script), tools=TOOLS,
                                         max_tokens=100)
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_tool_choice_none_keeps_markup_as_content(live, client):
    out = client.chat.completions.create(model=MODEL, messages=_ask(SCRIPT), tools=TOOLS,
                                         tool_choice="none", max_tokens=200)
    assert "# Tools" not in live.hook.prepared[-1].prompt_text
    message = out.choices[0].message
    assert message.tool_calls is None and message.content == "Let me check." + CALL
    assert out.choices[0].finish_reason == "stop"


def test_named_tool_choice_forces_the_call(live, client):
    # After the scripted end of reasoning the random model is free, except for the enforcement.
    out = client.chat.completions.create(
        model=MODEL, messages=_ask("PREFIX:hmm</think>"), tools=TOOLS, max_tokens=16,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = out.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert "# Tools" in live.hook.prepared[-1].prompt_text


def test_template_matches_transformers(live, client, tiny_dirs):
    history = [
        {"role": "developer", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "weather in "},
                                     {"type": "text", "text": "Paris and Rome?"}]},
        {"role": "assistant", "content": None, "reasoning_content": "need tool", "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
            {"id": "c2", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Rome", "opts": {"u": "C"}}'}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=1,
                                   reasoning_effort="high")
    prepared = live.hook.prepared[-1]
    hf_history = json.loads(json.dumps(history))
    hf_history[0]["role"] = "system"
    hf_history[2]["content"] = ""
    for call in hf_history[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    reference = PreTrainedTokenizerFast.from_pretrained(tiny_dirs["embedded"])
    expected = reference.apply_chat_template(hf_history, tools=TOOLS, tokenize=False,
                                             add_generation_prompt=True, reasoning_effort="high")
    assert prepared.prompt_text == expected
    assert "<|observation|><tool_response>sunny</tool_response><tool_response>rainy" in expected
    assert prepared.prompt_token_ids[0] == reference.encode(expected, add_special_tokens=False)
