"""Recorded GLM-5.3-Flash style generations for the output-parser tests.

Each text is what the model generates after a prompt ending `<|assistant|><think>` (unless the
case says otherwise), with the stop token already stripped by the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _tool(name: str, props: dict[str, Any], required: list[str] | None = None, **extra: Any):
    params = {"type": "object", "properties": props, **extra}
    if required:
        params["required"] = required
    function = {"name": name, "description": name, "parameters": params}
    return {"type": "function", "function": function}


STR = {"type": "string"}
TOOLS: list[dict[str, Any]] = [
    _tool("get_weather", {"city": STR, "days": {"type": "integer"}, "unit": {"enum": ["c", "f"]}}),
    _tool("get_time", {}),
    _tool("store", {"a": STR, "b": STR, "c": STR, "d": STR}),
    _tool(
        "search",
        {
            "query": STR,
            "limit": {"type": "integer"},
            "threshold": {"type": "number"},
            "exact": {"type": "boolean"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": STR},
        },
    ),
    _tool(
        "set_note",
        {
            "note": {"anyOf": [STR, {"type": "null"}]},
            "priority": {"$ref": "#/$defs/Priority"},
            "choice": {"oneOf": [{"type": "integer"}, {"type": "boolean"}]},
            "mode": {"const": "fast"},
        },
        **{"$defs": {"Priority": {"type": "integer"}}},
    ),
    _tool("write_file", {"path": STR, "content": STR}, ["path", "content"]),
    _tool("bash", {"command": STR}, ["command"]),
    _tool("run_in_terminal", {"command": STR}),
    {"type": "function", "function": {"name": "free_form"}},
]

_CODE_LINE = '    out.append("<li>{i}</li>\\t</arg_valu" + "e_x>")  # 例 {i}\n'
_CODE = (
    "def render(items: list[str]) -> str:\n"
    + '    """Render <li> items; a < b and "quotes" \\ back\\slash."""\n'
    + "".join(_CODE_LINE.format(i=i) for i in range(45))
    + "    return '\\n'.join(out)  # </tool_call"
)


@dataclass(slots=True)
class Case:
    id: str
    text: str
    reasoning: str | None
    content: str | None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)
    options: dict[str, bool] = field(default_factory=dict)
    exact_arguments: list[str] | None = None


def _c(name: str, body: str) -> str:
    return f"<tool_call>{name}{body}</tool_call>"


def _kv(key: str, value: str) -> str:
    return f"<arg_key>{key}</arg_key><arg_value>{value}</arg_value>"


WEATHER_PARIS = _c("get_weather", _kv("city", "Paris") + _kv("days", "2"))

# fmt: off
CASES: list[Case] = [
    Case("reasoning_then_text",
         "The user says hello. I should greet them back briefly.</think>Hello! How can I help?",
         "The user says hello. I should greet them back briefly.", "Hello! How can I help?"),
    Case("reasoning_then_call", "The user wants Paris weather for 2 days.</think>" + WEATHER_PARIS,
         "The user wants Paris weather for 2 days.", None,
         [("get_weather", {"city": "Paris", "days": 2})],
         exact_arguments=['{"city": "Paris", "days": 2}']),
    Case("parallel_calls",
         "Two cities and the time.</think>" + _c("get_weather", _kv("city", "Paris"))
         + _c("get_weather", _kv("city", "Rome") + _kv("unit", "f")) + _c("get_time", ""),
         "Two cities and the time.", None,
         [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome", "unit": "f"}),
          ("get_time", {})]),
    Case("zero_arg_call", "I need the current time.</think><tool_call>get_time</tool_call>",
         "I need the current time.", None, [("get_time", {})], exact_arguments=["{}"]),
    Case("string_params_look_like_json",
         "Store the literals.</think>" + _c("store", _kv("a", '{"a":1}') + _kv("b", "[1,2]")
                                            + _kv("c", "001") + _kv("d", "true")),
         "Store the literals.", None,
         [("store", {"a": '{"a":1}', "b": "[1,2]", "c": "001", "d": "true"})],
         exact_arguments=['{"a": "{\\"a\\":1}", "b": "[1,2]", "c": "001", "d": "true"}']),
    Case("typed_params",
         "Search.</think>" + _c("search", _kv("query", "rust async") + _kv("limit", "10")
                                + _kv("threshold", "0.75") + _kv("exact", "true")
                                + _kv("filters", '{"lang": "en", "year": 2024}')
                                + _kv("tags", '["tokio", "async-std"]')),
         "Search.", None,
         [("search", {"query": "rust async", "limit": 10, "threshold": 0.75, "exact": True,
                      "filters": {"lang": "en", "year": 2024}, "tags": ["tokio", "async-std"]})],
         exact_arguments=['{"query": "rust async", "limit": 10, "threshold": 0.75, '
                          '"exact": true, "filters": {"lang": "en", "year": 2024}, '
                          '"tags": ["tokio", "async-std"]}']),
    Case("lenient_typing",
         "Loose values.</think>" + _c("search", _kv("limit", "1.5") + _kv("threshold", "2")
                                      + _kv("exact", "True") + _kv("filters", "{'lang': 'de'}")
                                      + _kv("tags", '[\\"x\\"]') + _kv("query", " padded ")),
         "Loose values.", None,
         [("search", {"limit": 1.5, "threshold": 2, "exact": True, "filters": {"lang": "de"},
                      "tags": ["x"], "query": " padded "})]),
    Case("unicode_values",
         "Météo à Zürich — 東京も？</think>Voilà: "
         + _c("get_weather", _kv("city", 'Zürich 東京 🌧️ "q" back\\slash\nline')),
         "Météo à Zürich — 東京も？", "Voilà: ",
         [("get_weather", {"city": 'Zürich 東京 🌧️ "q" back\\slash\nline'})],
         exact_arguments=['{"city": "Zürich 東京 🌧️ \\"q\\" back\\\\slash\\nline"}']),
    Case("unknown_tool_dropped",
         "The user wants to wipe the disk.</think>Let me do that."
         + _c("delete_everything", _kv("path", "/")),
         "The user wants to wipe the disk.", "Let me do that."),
    Case("unknown_then_known",
         "Try both.</think>" + _c("lookup_stock", _kv("ticker", "ACME")) + _c("get_time", ""),
         "Try both.", None, [("get_time", {})]),
    Case("call_inside_reasoning",
         "I should check Oslo first." + _c("get_weather", _kv("city", "Oslo") + _kv("days", "1")),
         "I should check Oslo first.", None, [("get_weather", {"city": "Oslo", "days": 1})]),
    Case("call_inside_reasoning_then_close", "Checking.<tool_call>get_time</tool_call></think>",
         "Checking.", None, [("get_time", {})]),
    Case("glm45_whitespace",
         "Paris, then the time.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
         "<arg_value>Paris</arg_value>\n<arg_key> days </arg_key>\n<arg_value>3</arg_value>\n"
         "</tool_call>\n<tool_call>get_time\n</tool_call>\n",
         "Paris, then the time.", None,
         [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]),
    Case("content_before_calls",
         "Need the tool.</think>Let me check the weather for you.\n\n"
         + _c("get_weather", _kv("city", "Lyon")),
         "Need the tool.", "Let me check the weather for you.\n\n",
         [("get_weather", {"city": "Lyon"})]),
    Case("no_reasoning_close_truncated",
         "Let me think carefully. For n = 1 the sum is 1 < 2, and for n = 2 we get",
         "Let me think carefully. For n = 1 the sum is 1 < 2, and for n = 2 we get", None),
    Case("repeated_think", "\n<think>Simple arithmetic.</think>2 + 2 = 4.",
         "Simple arithmetic.", "2 + 2 = 4."),
    Case("empty_reasoning", "</think>Direct answer.", None, "Direct answer."),
    Case("whitespace_only_content", "Done.</think>\n\n", "Done.", None),
    Case("mtp_observation_tail",
         "ok</think>" + _c("bash", _kv("command", "ls -la")) + "<|observation|>",
         "ok", None, [("bash", {"command": "ls -la"})]),
    Case("long_code_string",
         "Write it.</think>" + _c("write_file", _kv("path", "r.py") + _kv("content", _CODE)),
         "Write it.", None, [("write_file", {"path": "r.py", "content": _CODE})]),
    Case("optional_ref_oneof_const",
         "Notes.</think>" + _c("set_note", _kv("note", "null") + _kv("priority", "3")
                               + _kv("choice", "true") + _kv("mode", "fast"))
         + _c("set_note", _kv("note", "buy milk") + _kv("choice", "7")),
         "Notes.", None,
         [("set_note", {"note": None, "priority": 3, "choice": True, "mode": "fast"}),
          ("set_note", {"note": "buy milk", "choice": 7})]),
    Case("truncated_in_string",
         "Writing.</think><tool_call>write_file<arg_key>path</arg_key><arg_value>a.py</arg_value>"
         "<arg_key>content</arg_key><arg_value>print('hi",
         "Writing.", None, [("write_file", {"path": "a.py", "content": "print('hi"})]),
    Case("truncated_in_number",
         "x</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Nice</arg_value>"
         "<arg_key>days</arg_key><arg_value>1",
         "x", None, [("get_weather", {"city": "Nice", "days": 1})]),
    Case("truncated_in_name", "x</think>Sure.<tool_call>get_wea", "x", "Sure."),
    Case("missing_arg_key",
         "run it</think><tool_call>bash\n<arg_value>echo hi</arg_value></tool_call>",
         "run it", None, [("bash", {"command": "echo hi"})]),
    Case("key_equals_value",
         "x</think>" + _c("get_weather", "<arg_key>city=Berlin</arg_key>" + _kv("days", "4")),
         "x", None, [("get_weather", {"city": "Berlin", "days": 4})]),
    Case("json_after_name",
         'x</think><tool_call>get_weather{"city": "Madrid", "days": 5}</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
         "x", None, [("get_weather", {"city": "Madrid", "days": 5}), ("get_time", {})]),
    Case("schemaless_typing",
         "x</think>" + _c("free_form", _kv("x", "123") + _kv("y", "hello") + _kv("z", "[1, 2]")),
         "x", None, [("free_form", {"x": 123, "y": "hello", "z": [1, 2]})]),
    Case("duplicate_key_first_wins",
         "x</think>" + _c("get_weather", _kv("city", "A") + _kv("city", "B")),
         "x", None, [("get_weather", {"city": "A"})]),
    Case("angle_brackets_in_content", "x</think>Use <b>bold</b>, a < b, <tool> and <tool_c",
         "x", "Use <b>bold</b>, a < b, <tool> and <tool_c"),
    Case("angle_brackets_in_reasoning", "Is </b> a tag? 1 < 2; </thinking is not </think>Yes.",
         "Is </b> a tag? 1 < 2; </thinking is not ", "Yes."),
    Case("prefill_closed_content_mode", "The answer is 4." + _c("get_time", ""), None,
         "The answer is 4.", [("get_time", {})], options={"starts_in_reasoning": False}),
    Case("reasoning_disabled", "Plain </think> text " + _c("get_time", ""), None,
         "Plain </think> text ", [("get_time", {})], options={"reasoning": False}),
    Case("tool_parsing_off", "r</think>Raw " + _c("get_time", ""), "r",
         "Raw <tool_call>get_time</tool_call>", tools=None),
    Case("name_split_candidates",
         "x</think>" + _c("run_in_terminal", _kv("command", "make test")),
         "x", None, [("run_in_terminal", {"command": "make test"})]),
]
# fmt: on
