"""glm45 reasoning + glm47 tool-call parsers: recorded outputs, typing rules and a re-split fuzz.

The re-split test feeds every recorded output split at every character boundary, one character
at a time and in random MTP-sized chunkings, and requires the streamed result to equal the
one-shot parse, with well-formed OpenAI tool-call deltas (spec/chat_api.md §2.3, §4.3).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import pytest

from glmflash.parsers.reasoning_parser import ReasoningParser, split_reasoning
from glmflash.parsers.tags import THINK_END, THINK_START, TOOL_CALL_START
from glmflash.parsers.tool_parser import (
    ChatDelta,
    ChatOutputParser,
    ToolCallStreamParser,
    parse_tool_calls,
)
from glmflash.parsers.tool_schema import coerce_value

from .parser_cases import CASES, TOOLS, WEATHER_PARIS, Case

CALL_ID_RE = re.compile(r"call_[0-9a-f]{24}")
SEED = 42


def _parser(case: Case) -> ChatOutputParser:
    return ChatOutputParser(case.tools, **case.options)


def _stream(case: Case, chunks: list[str]) -> dict[str, Any]:
    """Run the streaming parser and check every delta's shape on the way."""
    parser = _parser(case)
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    assert parser.finish() == []
    reasoning, content, calls = "", "", []
    for delta in deltas:
        fields = [delta.reasoning_content, delta.content, delta.tool_calls]
        assert sum(f is not None for f in fields) == 1 and all(f != "" for f in fields), delta
        reasoning += delta.reasoning_content or ""
        content += delta.content or ""
        if delta.tool_calls is not None:
            _check_tool_delta(delta, calls)
    parsed = [(name, args) for _, name, args in calls]
    return {
        "reasoning": reasoning,
        "content": content,
        "calls": parsed,
        "hint": parser.finish_reason_hint,
    }


def _check_tool_delta(delta: ChatDelta, calls: list[list[str]]) -> None:
    assert delta.tool_calls is not None and len(delta.tool_calls) == 1
    entry = delta.tool_calls[0]
    if "id" in entry:
        assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function"
        assert CALL_ID_RE.fullmatch(entry["id"]) and entry["index"] == len(calls)
        assert set(entry["function"]) == {"name", "arguments"}
        assert entry["function"]["name"] and entry["function"]["arguments"] == ""
        calls.append([entry["id"], entry["function"]["name"], ""])
    else:
        assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
        assert entry["index"] == len(calls) - 1, "fragment for a call that is not the open one"
        assert entry["function"]["arguments"]
        calls[-1][2] += entry["function"]["arguments"]


def _expected_stream(case: Case) -> dict[str, Any]:
    one = _parser(case).parse(case.text)
    calls = [(c.name, c.arguments) for c in one.tool_calls]
    return {
        "reasoning": one.reasoning_content or "",
        "content": one.content or "",
        "calls": calls,
        "hint": one.finish_reason_hint,
    }


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_recorded_output_one_shot(case: Case) -> None:
    one = _parser(case).parse(case.text)
    assert one.reasoning_content == case.reasoning
    assert one.content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == case.calls
    for call in one.tool_calls:
        assert CALL_ID_RE.fullmatch(call.id)
        assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    if case.exact_arguments is not None:
        assert [c.arguments for c in one.tool_calls] == case.exact_arguments
    assert one.finish_reason_hint == ("tool_calls" if case.calls else None)
    for tag in (THINK_END, TOOL_CALL_START):
        assert tag not in (one.reasoning_content or "")
    if case.tools is not None:
        assert TOOL_CALL_START not in (one.content or "")


def _random_chunks(text: str, rng: random.Random) -> list[str]:
    cuts, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 12)
        cuts.append(text[pos : pos + step])
        pos += step
    return cuts


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_stream_equals_one_shot_under_any_split(case: Case) -> None:
    expected = _expected_stream(case)
    text = case.text
    assert _stream(case, [text]) == expected
    assert _stream(case, list(text)) == expected, "one character at a time"
    for cut in range(len(text) + 1):
        assert _stream(case, [text[:cut], text[cut:]]) == expected, f"split at {cut}"
    rng = random.Random(SEED)
    for _ in range(30):
        assert _stream(case, _random_chunks(text, rng)) == expected


def test_reasoning_parser_never_emits_partial_tags() -> None:
    parser = ReasoningParser()
    assert parser.feed("<thi").reasoning == ""
    assert parser.feed("nk>Hmm, a<").reasoning == "Hmm, a"
    assert parser.feed("b </th").reasoning == "<b "
    delta = parser.feed("ink>Ans")
    assert (delta.reasoning, delta.content) == ("", "Ans")
    assert not parser.is_in_reasoning
    assert parser.feed("wer </think>").content == "wer </think>"
    tail = ReasoningParser()
    tail.feed("cut off at <tool_c")
    assert tail.finish().reasoning == "<tool_c"


def test_reasoning_split_keeps_tool_call_for_tool_parser() -> None:
    split = split_reasoning("Need data.<tool_call>get_time</tool_call>")
    assert split == ("Need data.", "<tool_call>get_time</tool_call>")
    assert split_reasoning("answer", starts_in_reasoning=False) == ("", "answer")
    assert split_reasoning(f"{THINK_START}{THINK_START}x</think>y") == (THINK_START + "x", "y")


def test_tool_stream_content_never_holds_a_partial_tag_as_content() -> None:
    parser = ToolCallStreamParser(TOOLS)
    assert [e.content for e in parser.feed("Let me check.<tool")] == ["Let me check."]
    events = parser.feed("_call>get_time</tool_call>")
    assert all(e.content is None for e in events)
    assert [e.tool_call["function"] for e in events] == [
        {"name": "get_time", "arguments": ""},
        {"arguments": "{}"},
    ]


def test_zero_arg_call_in_a_single_mtp_delta_is_streamed() -> None:
    # vLLM #44326/#41654/#48131: finish_reason tool_calls with no delta.tool_calls.
    parser = ChatOutputParser(TOOLS)
    deltas = parser.feed("t</think><tool_call>get_time</tool_call><|observation|>")
    deltas += parser.finish()
    entries = [d.tool_calls[0] for d in deltas if d.tool_calls]
    assert entries[0]["function"]["name"] == "get_time"
    assert "".join(e["function"]["arguments"] for e in entries) == "{}"
    assert parser.finish_reason_hint == "tool_calls"


def test_name_is_sent_only_when_complete() -> None:
    # vLLM #39757/#40071: `run_in_terminal` streamed as `run_in`.
    parser = ToolCallStreamParser(TOOLS)
    assert parser.feed("<tool_call>run_in") == []
    assert parser.feed("_terminal") == []
    assert parser.feed("<arg_") == []
    header = parser.feed("key>command</arg_key>")[0].tool_call
    assert header["function"]["name"] == "run_in_terminal"


def test_long_string_value_streams_before_it_closes() -> None:
    # vLLM #32829: 4k-char code arguments buffered until </arg_value>.
    parser = ToolCallStreamParser(TOOLS)
    parser.feed("<tool_call>write_file<arg_key>content</arg_key><arg_value>")
    pieces = [parser.feed("x = 1\n" * 50) for _ in range(3)]
    assert all(p and p[0].tool_call["function"]["arguments"] == "x = 1\\n" * 50 for p in pieces)


def test_non_string_values_wait_for_close_and_keep_their_type() -> None:
    # SGLang #35564: `{"x": 123}` streamed as `"123"` when the schema does not declare a type.
    parser = ToolCallStreamParser(TOOLS)
    events = parser.feed("<tool_call>free_form<arg_key>x</arg_key><arg_value>12")
    assert "12" not in "".join(e.tool_call["function"]["arguments"] for e in events)
    events = parser.feed("3</arg_value></tool_call>")
    assert "".join(e.tool_call["function"]["arguments"] for e in events) == '"x": 123}'


def test_optional_string_and_array_are_not_corrupted() -> None:
    # vLLM #40197: `Smithh"` and `["a","b"]]` in streaming.
    text = _kv_call("set_note", note="Smith") + _kv_call("search", tags='["a","b"]')
    parser = ToolCallStreamParser(TOOLS)
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    args = ["", ""]
    for event in events:
        args[event.tool_call["index"]] += event.tool_call["function"]["arguments"]
    assert [json.loads(a) for a in args] == [{"note": "Smith"}, {"tags": ["a", "b"]}]
    assert [c.arguments for c in parse_tool_calls(text, TOOLS).tool_calls] == args


def _kv_call(name: str, **kwargs: str) -> str:
    body = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in kwargs.items())
    return f"<tool_call>{name}{body}</tool_call>"


def test_arguments_are_a_json_string_serialised_once() -> None:
    # vLLM #36410/#37385/#35208: arguments re-dumped (double-encoded) or a duplicated final flush.
    parser = ChatOutputParser(TOOLS)
    deltas = parser.feed("r</think>" + WEATHER_PARIS) + parser.finish() + parser.finish()
    args = "".join(d.tool_calls[0]["function"]["arguments"] for d in deltas if d.tool_calls)
    assert args == '{"city": "Paris", "days": 2}'
    assert isinstance(json.loads(args), dict)


def _strict_json(text: str) -> Any:
    def reject(name: str) -> None:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=reject)


NON_FINITE_TOOLS = [{"type": "function", "function": {"name": "set_limit", "parameters": {
    "type": "object", "properties": {"limit": {"type": "number"}, "tag": {}}}}}]


@pytest.mark.parametrize("text,want", [
    (_kv_call("set_limit", limit="1e400"), {"limit": "1e400"}),
    (_kv_call("set_limit", tag="[1, 1e400]"), {"tag": "[1, 1e400]"}),
    (_kv_call("set_limit", limit="2.5"), {"limit": 2.5}),
    ('<tool_call>set_limit{"limit": NaN}</tool_call>', {"limit": "NaN"}),
    ('<tool_call>{"name": "set_limit", "arguments": {"limit": 1e999}}</tool_call>',
     {"limit": "1e999"}),
], ids=["number", "untyped", "finite", "inline_nan", "inline_overflow"])
def test_non_finite_numbers_stay_valid_json(text: str, want: dict) -> None:
    """JSON has no NaN or Infinity: a value that would parse to one (1e400 overflows a float)
    keeps its text, so `arguments` stays JSON for strict clients, in one shot and streamed."""
    (call,) = parse_tool_calls(text, NON_FINITE_TOOLS).tool_calls
    assert _strict_json(call.arguments) == want
    parser = ChatOutputParser(NON_FINITE_TOOLS)
    deltas = parser.feed("r</think>" + text) + parser.finish()
    streamed = "".join(d.tool_calls[0]["function"].get("arguments") or ""
                       for d in deltas if d.tool_calls)
    assert _strict_json(streamed) == want


def test_parallel_calls_get_sequential_indices_and_unique_ids() -> None:
    text = "".join(_kv_call("get_weather", city=c) for c in ("A", "B", "C"))
    parsed = parse_tool_calls("  \n" + text, TOOLS)
    assert parsed.content is None and len({c.id for c in parsed.tool_calls}) == 3
    assert parsed.tool_calls[0].to_openai()["function"]["name"] == "get_weather"


def test_unknown_names_dropped_only_when_tools_are_given() -> None:
    text = _kv_call("made_up", q="1")
    assert parse_tool_calls(text, TOOLS).tool_calls == []
    assert parse_tool_calls(text, []).tool_calls == []
    assert [c.arguments for c in parse_tool_calls(text, None).tool_calls] == ['{"q": 1}']


COERCE_TABLE: list[tuple[str, str, Any]] = [
    # (raw text, allowed types joined by "|", expected value)
    ('{"a":1}', "string", '{"a":1}'),
    ("001", "string", "001"),
    ("true", "string", "true"),
    (" x ", "string", " x "),
    ("3", "integer", 3),
    ("3.0", "integer", 3),
    ("1.5", "integer", 1.5),
    ("abc", "integer", "abc"),
    ("2", "number", 2),
    ("2.5e1", "number", 25.0),
    ("NaN", "number", "NaN"),
    ("false", "boolean", False),
    ("True", "boolean", True),
    ("null", "string|null", None),
    ("None", "string|null", None),
    ("hello", "string|null", "hello"),
    ("[1, 2]", "array", [1, 2]),
    ("(1, 2)", "array", [1, 2]),
    ('{\\"k\\": [1]}', "object", {"k": [1]}),
    ("{'k': None}", "object", {"k": None}),
    ("42", "", 42),
    ("'q'", "", "'q'"),
    ("None", "", "None"),
    ('"q"', "", "q"),
]


@pytest.mark.parametrize("raw, types, expected", COERCE_TABLE)
def test_coerce_value(raw: str, types: str, expected: Any) -> None:
    value = coerce_value(raw, frozenset(filter(None, types.split("|"))))
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("schema", [{"anyOf": 5}, {"oneOf": True}, {"allOf": 3}])
def test_a_combinator_that_is_not_a_list_is_ignored(schema: dict) -> None:
    """A client's malformed `anyOf` / `oneOf` / `allOf` leaves the value as written (it took
    the call's parse, and the request, down)."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}}}}]
    call = f"{TOOL_CALL_START}f<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"
    parsed = parse_tool_calls(call, tools)
    assert [c.name for c in parsed.tool_calls] == ["f"]
