"""tool_choice `required` and named functions are enforced by the parsers' state, not by any
occurrence of a tag: scripted outputs that once escaped it, and sampled outputs of the random
model pushed towards the tags."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from glmflash.server.processors import ForcedToolCall, NameTrie, ToolTokenIds
from tests.server.conftest import MODEL
from tests.server.test_tools import TOOLS

NAMES = {"get_weather", "get_time"}
VOCAB = 1088


def _ids(live) -> ToolTokenIds:
    return ToolTokenIds.from_tokenizer(live.engine.tokenizer)


def _allowed(processor, output_ids: list[int]) -> set[int]:
    row = processor(output_ids, torch.zeros(VOCAB))
    return set(torch.nonzero(row > float("-inf")).flatten().tolist())


def test_the_processor_follows_the_parser_state(live):
    ids, eos = _ids(live), sorted(live.engine.eos_token_ids)
    forced = ForcedToolCall(ids, eos, [[7, 8], [7, 9, 10]], starts_in_reasoning=True)
    free, in_call = set(range(VOCAB)) - set(eos), set(range(VOCAB)) - set(eos) - {
        ids.call_start, ids.think_end}
    assert _allowed(forced, [1, 2]) == free
    # A </tool_call> (or a whole call) inside the reasoning does not end the enforcement.
    assert _allowed(forced, [1, ids.call_end, 2]) == free
    assert _allowed(forced, [1, ids.call_end, ids.think_end]) == {ids.call_start}
    assert _allowed(forced, [1, ids.think_end, ids.call_start]) == {7}
    assert _allowed(forced, [1, ids.think_end, ids.call_start, 7]) == {8, 9}
    assert _allowed(forced, [1, ids.think_end, ids.call_start, 7, 8]) == {ids.arg_key,
                                                                         ids.call_end}
    assert _allowed(forced, [1, ids.think_end, ids.call_start, 7, 9]) == {10}
    assert _allowed(forced, [ids.think_end, ids.call_start, 7, 8, ids.arg_key, 3]) == in_call
    assert _allowed(forced, [ids.think_end, ids.call_start, 7, 8, ids.call_end]) == \
        set(range(VOCAB))
    # A <tool_call> ends the reasoning too (the reasoning parser splits there).
    assert _allowed(forced, [1, ids.call_start]) == {7}
    required = ForcedToolCall(ids, eos, [[7]], starts_in_reasoning=False)
    assert _allowed(required, []) == {ids.call_start}


def test_name_trie():
    trie = NameTrie([[1, 2], [1, 2, 3], [4]])
    assert sorted(trie.next_ids([]).ids) == [1, 4] and not trie.next_ids([]).is_complete
    assert trie.next_ids([1, 2]) == ([3], True)
    assert trie.next_ids([1, 2, 99]) is None


def _script(text: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "tools": TOOLS,
            "max_tokens": 40, **extra}


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get_time"}}])
@pytest.mark.parametrize("stream", [False, True])
def test_tags_inside_the_reasoning_do_not_escape(live, tool_choice, stream):
    # The model closes a call inside its reasoning, then ends the reasoning: a call must follow.
    # Once free, it closes the call (the bias) and then stops (eos, banned until then).
    ids = _ids(live)
    bias = {str(ids.call_end): 10, **{str(t): 12 for t in live.engine.eos_token_ids}}
    body = _script("PREFIX:hmm </tool_call> and <arg_key> ok</think>", tool_choice=tool_choice,
                   stream=stream, logit_bias=bias)
    message, finish = _complete(live.url, body)
    names = [c["function"]["name"] for c in message["tool_calls"]]
    assert finish == "tool_calls" and names and set(names) <= NAMES
    if isinstance(tool_choice, dict):
        assert names[0] == "get_time"
    assert "</tool_call>" in message["reasoning_content"]


def _complete(url: str, body: dict) -> tuple[dict, str]:
    """The assistant message and finish reason, assembled from a stream when `stream`."""
    if not body.get("stream"):
        out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        return out["choices"][0]["message"], out["choices"][0]["finish_reason"]
    message: dict = {"reasoning_content": "", "content": "", "tool_calls": []}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"]
                message["reasoning_content"] += delta.get("reasoning_content") or ""
                message["content"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    if call.get("id"):
                        message["tool_calls"].append({"function": {"name": call["function"][
                            "name"]}})
                finish = choice["finish_reason"] or finish
    return message, finish


@pytest.mark.parametrize("stream", [False, True])
def test_sampled_outputs_always_call_a_tool(live, stream):
    """The random model, sampled, with its tag tokens made likely: every choice that does not
    run out of tokens ends in a call to a known tool, reasoning tags notwithstanding."""
    ids = _ids(live)
    bias = {str(ids.think_end): 4, str(ids.call_end): 5, str(ids.call_start): 2,
            **{str(t): 3 for t in live.engine.eos_token_ids}}
    body = _script("what now?", tool_choice="required", temperature=1.0, n=8, seed=5,
                   max_tokens=120, logit_bias=bias)
    out = httpx.post(f"{live.url}/v1/chat/completions", json={**body, "stream": False},
                     timeout=300).json()
    finished = [c for c in out["choices"] if c["finish_reason"] != "length"]
    assert len(finished) >= 4, [c["finish_reason"] for c in out["choices"]]
    for choice in finished:
        calls = choice["message"].get("tool_calls") or []
        assert choice["finish_reason"] == "tool_calls" and calls, choice
        assert {c["function"]["name"] for c in calls} <= NAMES
    reasoning = " ".join(c["message"]["reasoning_content"] or "" for c in out["choices"])
    assert "</tool_call>" in reasoning  # the old escape was exercised
    if stream:
        message, finish = _complete(live.url, {**body, "n": 1, "stream": True})
        assert finish == "length" or finish == "tool_calls" and message["tool_calls"]
    live.wait_idle()
