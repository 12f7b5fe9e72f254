"""Tokenizer layer: the tiny BPE files, encode/decode, the GLM chat template (spec/chat_api.md
§1.2, checked against transformers) and the incremental detokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import jinja2
import pytest

from glmflash.tiny.tokenizer_files import write_tiny_tokenizer
from glmflash.tokenizer import (
    GLM_ADDED_TOKENS,
    IncrementalDetokenizer,
    Tokenizer,
    normalize_messages,
    render_chat_template,
)

BASE = 1024
PREFIX = "[gMASK]<sop><|system|>Reasoning Effort: Max"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Get weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
}  # fmt: skip
WEATHER_LINE = (
    '{"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}}, "required": ["city"]}}'
)
TOOLS_HEAD = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_TAIL = (
    "</tools>\n\nFor each function call, output the function name and arguments within the "
    "following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
    "{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
    "...</tool_call>"
)
UNICODE_SAMPLES = [
    "plain ASCII, with punctuation!?",
    "café naïve crème brûlée Zürich São Paulo",
    "e\u0301 a\u0308 n\u0303 combining marks \u0327\u0328",
    "你好，世界。日本語のテキスト 한국어 텍스트",
    "emoji 🙂🙃👍🏽 👩‍👩‍👧 🇯🇵 ❤️ 🧀🥐",
    "tabs\tnew\nlines\r\n  spaces   ",
    "math ∑ Δt ≈ 1.618 φ √5 µm Ω 𝔘𝔫𝔦",
    "",
]


def _tool_round_trip() -> list[dict]:
    calls = [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
        {"id": "c2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Rome", "opts": {"u": "C"}}}},
    ]  # fmt: skip
    return [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c2", "content": "rainy"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]


def _random_text(rng: random.Random, length: int) -> str:
    blocks = [(0x20, 0x7E), (0xA0, 0x24F), (0x300, 0x36F), (0x370, 0x4FF), (0x3040, 0x30FF),
              (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1F64F),
              (0x1F900, 0x1F9FF)]  # fmt: skip
    chars = []
    for _ in range(length):
        low, high = rng.choice(blocks)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    write_tiny_tokenizer(path, base_vocab_size=BASE)
    return path


@pytest.fixture(scope="session")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


@pytest.fixture(scope="session")
def hf_tok(tiny_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(tiny_dir)


def test_tiny_tokenizer_is_deterministic(tmp_path: Path) -> None:
    ids_a = write_tiny_tokenizer(tmp_path / "a")
    ids_b = write_tiny_tokenizer(tmp_path / "b")
    assert ids_a == ids_b == {token: BASE + i for i, token in enumerate(GLM_ADDED_TOKENS)}
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert len(GLM_ADDED_TOKENS) == 36
    assert tok.vocab_size == BASE + 36
    assert [tok.token_to_id(t) for t in GLM_ADDED_TOKENS] == list(range(BASE, BASE + 36))
    assert tok.id_to_token(BASE + 22) == "</think>"
    assert tok.token_to_id("<|image|>") == BASE + 34 and tok.token_to_id("<|video|>") == BASE + 35
    assert tok.eos_token_ids == (BASE, BASE + 7, BASE + 9)
    assert tok.pad_token_id == BASE
    assert tok.token_to_id("no such token") is None


def test_round_trip_unicode(tok: Tokenizer) -> None:
    rng = random.Random(42)
    texts = UNICODE_SAMPLES + [_random_text(rng, rng.randint(1, 60)) for _ in range(100)]
    for text in texts:
        assert tok.decode(tok.encode(text)) == text


def test_added_tokens_are_single_ids(tok: Tokenizer) -> None:
    for token_id, token in enumerate(GLM_ADDED_TOKENS, start=BASE):
        assert tok.encode(token) == [token_id]
        ids = tok.encode(f"x{token}y é")
        assert token_id in ids and tok.decode(ids) == f"x{token}y é"
    ids = tok.encode("<|user|>hi<|assistant|><think>ok</think>")
    assert tok.decode(ids, skip_special_tokens=True) == "hi<think>ok</think>"


# fmt: off
def _spec_examples() -> dict[str, tuple[list, dict, str]]:
    """The verified rendered strings of spec/chat_api.md §1.2."""
    hi = [{"role": "user", "content": "hi"}]
    media = [{"type": "image"}, {"type": "text", "text": "Describe."}, {"type": "video"}]
    reply = {"role": "assistant", "content": "hello there"}
    chat = [*hi, reply, {"role": "user", "content": "bye"}]
    return {
        "user": (hi, {}, PREFIX + "<|user|>hi<|assistant|><think>"),
        "effort-low": (hi, {"reasoning_effort": "low"},
                       "[gMASK]<sop><|system|>Reasoning Effort: Low<|user|>hi<|assistant|><think>"),
        "system": ([{"role": "system", "content": "You are X."}, *hi], {},
                   PREFIX + "<|system|>You are X.<|user|>hi<|assistant|><think>"),
        "tool-round-trip": (_tool_round_trip(), {}, PREFIX + "<|user|>weather?<|assistant|>"
            "<think>need tool</think><tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris"
            "</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call><tool_call>"
            "get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value><arg_key>opts</arg_key>"
            '<arg_value>{"u": "C"}</arg_value></tool_call><|observation|><tool_response>sunny'
            "</tool_response><tool_response>rainy</tool_response><|assistant|><think>"),
        "no-reasoning": (chat, {}, PREFIX + "<|user|>hi<|assistant|><think></think>hello there"
                         "<|user|>bye<|assistant|><think>"),
        "image-video": ([{"role": "user", "content": media}], {}, PREFIX + "<|user|>"
                        "<|begin_of_image|><|image|><|end_of_image|>Describe.<|begin_of_video|>"
                        "<|video|><|end_of_video|><|assistant|><think>"),
    }
# fmt: on


@pytest.mark.parametrize("name", list(_spec_examples()))
def test_spec_examples(tok: Tokenizer, name: str) -> None:
    messages, kwargs, expected = _spec_examples()[name]
    assert tok.apply_chat_template(messages, **kwargs) == expected


def test_tools_block(tok: Tokenizer) -> None:
    hidden = {"name": "hidden", "parameters": {}, "defer_loading": True}
    flat = {"name": "météo", "description": "天气", "strict": True, "parameters": {}}
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], [WEATHER, hidden, flat])
    flat_line = '{"name": "météo", "description": "天气", "parameters": {}}'
    expected = PREFIX + TOOLS_HEAD + WEATHER_LINE + "\n" + flat_line + "\n" + TOOLS_TAIL
    assert text == expected + "<|user|>hi<|assistant|><think>"


def test_reasoning_rules(tok: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "\nx<think>r1</think> one ", "reasoning": None},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "two", "reasoning": "r2"},
    ]
    kept = (
        PREFIX + "<|user|>a<|assistant|><think>r1</think>one<|user|>b"
        "<|assistant|><think>r2</think>two"
    )
    cleared = kept.replace("<think>r1</think>", "<think></think>")
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == kept
    assert tok.apply_chat_template(messages, None, False, clear_thinking=True) == cleared


def test_tool_results_fallback_and_reference(tok: Tokenizer) -> None:
    messages = _tool_round_trip()
    messages[3]["tool_call_id"] = "zz"
    text = tok.apply_chat_template(messages)
    assert "<|observation|><tool_response>rainy</tool_response><tool_response>sunny" in text
    ref = {"role": "tool", "tool_call_id": "c1",
           "content": [{"type": "text", "text": "found"},
                       {"type": "tool_reference", "tool_name": "get_weather"}]}  # fmt: skip
    text = tok.apply_chat_template([*messages[:2], ref], [{**WEATHER, "defer_loading": True}])
    assert f"<tool_response>found<tools>\n{WEATHER_LINE}\n</tools></tool_response>" in text


def test_string_arguments_raise_in_template(tok: Tokenizer) -> None:
    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    with pytest.raises(jinja2.TemplateError):
        render_chat_template(tok.chat_template, messages)


def test_normalize_messages() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "assistant", "content": None, "reasoning": "why", "tool_calls": [call]},
        {"role": "assistant", "content": "x", "tool_calls": [{"name": "g", "arguments": " "}]},
    ]
    out = normalize_messages(messages)
    assert out[0] == {"role": "system", "content": "rules"}
    assert out[1]["content"] == "" and out[1]["reasoning_content"] == "why"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": [1]}
    assert out[2]["tool_calls"][0]["arguments"] == {}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": [1]}'
    for bad in ("{not json", "[1, 2]", [1, 2]):
        bad_call = {"function": {"name": "f", "arguments": bad}}
        with pytest.raises(ValueError, match="message 0"):
            normalize_messages([{"role": "assistant", "content": "", "tool_calls": [bad_call]}])
    with pytest.raises(ValueError, match="not an object"):
        normalize_messages([{"role": "assistant", "tool_calls": ["f(1)"]}])


# fmt: off
def _equivalence_cases() -> list[tuple[list, list | None, dict]]:
    flat = {"name": "lookup", "description": 'Look up ✓ «quotes» "x"', "strict": False,
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
    args = {"q": 'say "hi" ü', "n": 3, "ok": True, "none": None, "xs": [1, 2.5], "d": {"k": "ü"}}
    calls = [{"id": "a", "function": {"name": "lookup", "arguments": args}},
             {"id": "b", "name": "get_weather", "arguments": {"city": "東京"}}]
    agent = [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "go"},
        {"role": "assistant", "content": " plan ", "reasoning_content": "think 1",
         "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b",
         "content": [{"type": "text", "text": "22°C"}, {"type": "image_url"}]},
        {"role": "tool", "tool_call_id": "a", "content": "found"},
        {"role": "assistant", "content": "<think>think 2</think>done"},
        {"role": "user", "content": "thanks"},
    ]
    media = [
        {"role": "system", "content": [{"type": "text", "text": "look"}]},
        {"role": "user", "content": ["a", {"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "video_url"}, {"type": "input_audio"},
                                     {"type": "unknown"}, {"type": "text", "text": "b"}]},
    ]
    search = {"id": "t", "function": {"name": "search", "arguments": {}}}
    ref = [
        {"role": "user", "content": "find"},
        {"role": "assistant", "content": "", "tool_calls": [search]},
        {"role": "tool", "id": "t", "content": [{"type": "tool_reference", "name": "lookup"}]},
    ]
    return [
        (agent, [WEATHER, flat], {}),
        (agent, [WEATHER], {"clear_thinking": True, "reasoning_effort": "high"}),
        (media, None, {"reasoning_effort": "max"}),
        (ref, [{**flat, "defer_loading": True}, WEATHER], {"reasoning_effort": "low"}),
        (_tool_round_trip()[:3], [], {"clear_thinking": False}),
    ]
# fmt: on


@pytest.mark.parametrize("case", range(len(_equivalence_cases())))
def test_matches_transformers(tok: Tokenizer, hf_tok, case: int) -> None:
    messages, tools, kwargs = _equivalence_cases()[case]
    for add_prompt in (True, False):
        ours = tok.apply_chat_template(messages, tools, add_prompt, **kwargs)
        theirs = hf_tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_prompt, **kwargs
        )
        assert ours == theirs
        assert tok.encode(ours) == hf_tok(ours, add_special_tokens=False)["input_ids"]


def test_transformers_loads_tiny_files(tiny_dir: Path, tok: Tokenizer) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_dir)
    text = "[gMASK]<sop><|user|>héllo 🙂<|assistant|><think>x</think><tool_call>f</tool_call>"
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert ids == tok.encode(text) and hf.eos_token_id == hf.pad_token_id == BASE
    assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)
    assert (
        hf.decode(ids, skip_special_tokens=True)
        == "héllo 🙂<think>x</think><tool_call>f</tool_call>"
    )


def test_raw_render_matches_transformers(tok: Tokenizer, hf_tok) -> None:
    messages = [{"role": "developer", "content": "dropped"}, {"role": "user", "content": "q"},
                {"role": "assistant", "content": None, "thinking": "t"}]  # fmt: skip
    ours = render_chat_template(tok.chat_template, messages, None, False)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    # NOTE: transformers 5.x drops None-valued keys, so `content: None` renders as "".
    assert ours == theirs == PREFIX + "<|user|>q<|assistant|><think>t</think>"


def _stream(detok: IncrementalDetokenizer, ids: list[int], steps: list[int]) -> list[str]:
    rng, pieces, start = random.Random(len(ids)), [], 0
    while start < len(ids):
        step = rng.choice(steps)
        pieces.append(detok.add(ids[start : start + step]))
        start += step
    return [*pieces, detok.flush()]


def test_incremental_detokenizer(tok: Tokenizer) -> None:
    rng = random.Random(42)
    num_split_chars = 0
    texts = UNICODE_SAMPLES + [_random_text(rng, rng.randint(1, 40)) for _ in range(150)]
    for text in texts:
        ids = tok.encode(f"<think>{text}</think><|user|>")
        num_split_chars += sum("\ufffd" in tok.decode([i]) for i in ids)
        for skip, steps in ((False, [1]), (True, [1, 2, 3])):
            pieces = _stream(IncrementalDetokenizer(tok, skip_special_tokens=skip), ids, steps)
            assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
            assert not any("\ufffd" in piece for piece in pieces)
    assert num_split_chars > 100


def test_detokenizer_emits_each_character_once_complete(tok: Tokenizer) -> None:
    rng = random.Random(7)
    for _ in range(50):
        ids = tok.encode(_random_text(rng, 30))
        detok, emitted = IncrementalDetokenizer(tok), ""
        for k in range(1, len(ids) + 1):
            emitted += detok.add(ids[k - 1 : k])
            assert emitted == tok.decode(ids[:k]).rstrip("\ufffd")
        assert detok.flush() == ""
    # "Ã" is the byte-level symbol of the lone UTF-8 lead byte 0xC3.
    detok = IncrementalDetokenizer(tok)
    assert detok.add([tok.token_to_id("Ã")]) == "" and detok.flush() == "\ufffd"


def test_detokenizer_window_stays_small(tiny_dir: Path) -> None:
    window_lens = []

    class SpyTokenizer(Tokenizer):
        def decode(self, token_ids, skip_special_tokens=False):  # type: ignore[override]
            window_lens.append(len(token_ids))
            return super().decode(token_ids, skip_special_tokens)

    spy = SpyTokenizer.from_dir(tiny_dir)
    ids = spy.encode(" ".join(UNICODE_SAMPLES) * 20)
    expected = spy.decode(ids)
    window_lens.clear()
    detok = IncrementalDetokenizer(spy)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == expected
    # one small decode per add() plus one for flush(), never the whole sequence
    assert len(window_lens) == len(ids) + 1 and max(window_lens) <= 8


def test_a_tokenizer_config_that_is_not_an_object_is_named(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="tokenizer_config.json: expected a JSON object"):
        Tokenizer.from_dir(tmp_path)


def test_a_broken_chat_template_is_refused_at_load(tmp_path: Path) -> None:
    """Not at the first chat request (every one would fail): the file and line are named."""
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match=r"chat_template.jinja: invalid chat template \(line 1"):
        Tokenizer.from_dir(tmp_path)
