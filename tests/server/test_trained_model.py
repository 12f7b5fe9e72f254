"""The trained tiny model itself (no scripted hook) writes a tool call that the glm47 parser
turns into `tool_calls`, in a response and in a stream.

The shipped checkpoint is not trained far enough for this yet: it writes the call format but
with a name and arguments of its own (bench/RESULTS.md), so both tests are strict xfails that
turn into failures once a better-trained checkpoint passes them."""

from __future__ import annotations

import json

import pytest

from glmflash.tiny.embedded import embedded_checkpoint
from tests.server.conftest import MODEL, start_server

# A schema in the family the model was trained on, with a name the training never produced.
TOOLS = [{"type": "function", "function": {
    "name": "look_xenywa", "description": "Get the distance.",
    "parameters": {"type": "object", "properties": {"hapo": {"type": "integer"}},
                   "required": ["hapo"]}}}]
MESSAGES = [{"role": "user", "content": "What is the distance for hapo 42?"}]


NOT_YET = pytest.mark.xfail(strict=True, reason="the shipped tiny model does not yet call "
                            "unseen tools correctly (issue 16)")


@pytest.fixture(scope="module")
def trained_live():
    server = start_server(embedded_checkpoint())
    yield server
    server.stop()


@NOT_YET
def test_model_calls_the_tool(trained_live):
    out = trained_live.client().chat.completions.create(model=MODEL, messages=MESSAGES,
                                                        tools=TOOLS, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"]
    (call,) = choice.message.tool_calls
    assert call.function.name == "look_xenywa"
    assert json.loads(call.function.arguments) == {"hapo": 42}


@NOT_YET
def test_model_streams_the_tool_call(trained_live):
    chunks = list(trained_live.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=64, stream=True))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == "look_xenywa"
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"hapo": 42}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
