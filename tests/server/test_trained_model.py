"""The trained tiny model itself (no scripted hook) writes a tool call that the glm47 parser
turns into `tool_calls`, in a response and in a stream, for requests with held-out tools
(names the training never drew).

A checkpoint whose recorded eval (manifest) calls unseen tools correctly less than a quarter of
the time is not expected to pass: both tests are then strict xfails, which turn into failures
once a better-trained checkpoint passes them."""

from __future__ import annotations

import json

import pytest

from glmflash.tiny.embedded import embedded_checkpoint
from glmflash.tiny.manifest import read_manifest
from tests.server.conftest import MODEL, start_server
from tools.eval_tiny import held_out_tool_cases

CASES = held_out_tool_cases(3000, 4)
RECORDED_RIGHT_CALLS = read_manifest(embedded_checkpoint())["eval"]["tools"]["right_call"]
NOT_YET = pytest.mark.xfail(RECORDED_RIGHT_CALLS < 0.25, strict=True,
                            reason="the shipped tiny model does not call unseen tools correctly")


@pytest.fixture(scope="module")
def trained_live():
    server = start_server(embedded_checkpoint())
    yield server
    server.stop()


def _messages(case) -> list[dict]:
    return [{"role": "user", "content": case.user}]


@pytest.fixture(scope="module")
def answered(trained_live):
    """The first held-out case the model calls right, with its response (None if none)."""
    for case in CASES:
        out = trained_live.client().chat.completions.create(
            model=MODEL, messages=_messages(case), tools=case.tools, max_tokens=64)
        calls = out.choices[0].message.tool_calls or []
        if len(calls) == 1 and calls[0].function.name == case.name and \
                json.loads(calls[0].function.arguments) == case.arguments:
            return case, out
    return None


@NOT_YET
def test_model_calls_the_tool(answered):
    assert answered is not None, "no held-out case called right"
    _, out = answered
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"]


@NOT_YET
def test_model_streams_the_tool_call(trained_live, answered):
    assert answered is not None, "no held-out case called right"
    case, _ = answered
    chunks = list(trained_live.client().chat.completions.create(
        model=MODEL, messages=_messages(case), tools=case.tools, max_tokens=64, stream=True))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert calls[0].function.name == case.name
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == case.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
