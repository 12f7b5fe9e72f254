"""Engine.chat: template in, reasoning and glm47 tool calls out (scripted model output)."""

from __future__ import annotations

import json

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.penalties import apply_penalties
from glmflash.engine.sequence import Sequence
from tests.engine.scripted import ScriptedOutput

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=1024,
                  background_loop=False)


def _scripted(engine, text: str) -> SamplingParams:
    eos = engine.tokenizer.token_to_id("<|observation|>")
    return SamplingParams(max_tokens=200, temperature=0,
                          logits_processors=[ScriptedOutput(engine.tokenizer.encode(text), eos)])


def test_chat_splits_reasoning_and_parses_tool_calls(engine):
    text = ("The user wants weather.</think>Let me check."
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
            "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")
    out = engine.chat([{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
                      sampling_params=_scripted(engine, text))
    assert out.reasoning_content == "The user wants weather."
    assert out.content == "Let me check."
    assert out.finish_reason == "tool_calls"
    (call,) = out.tool_calls
    assert call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 2}


def test_chat_plain_answer(engine):
    out = engine.chat([{"role": "user", "content": "hi"}], sampling_params=_scripted(
        engine, "short thought</think>Hello!"), reasoning_effort="low")
    assert (out.reasoning_content, out.content, out.tool_calls) == ("short thought", "Hello!", [])
    assert out.finish_reason == "stop"


def test_penalties_change_scores():
    seq = Sequence(0, [1, 2], SamplingParams(repetition_penalty=2.0, presence_penalty=1.0,
                                             frequency_penalty=0.5))
    seq.token_ids.extend([3, 3])
    row = torch.tensor([1.0, 2.0, -2.0, 4.0, 5.0])
    out = apply_penalties(row, seq)
    # ids 1,2,3 seen: positive / 2, negative * 2; id 3 seen twice in the output: -1 - 2*0.5.
    assert out.tolist() == [1.0, 1.0, -4.0, 2.0 - 1.0 - 1.0, 5.0]
