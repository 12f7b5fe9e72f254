"""The scripts in examples/ run against a live server. The random tiny model cannot choose to
call a tool, so a test hook writes its turns where tools are offered: a call to the first tool
after a user message, an answer quoting the result after a tool message. LiteLLM and lm-eval
are optional (`glmflash[examples]`); their tests skip without them."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from tests.engine.scripted import ScriptedOutput
from tests.server.conftest import start_server

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ARGUMENTS = {"city": "Paris", "expression": "17 * 23"}


class ToolTurnHook:
    """Scripts the model's turn in requests that offer tools (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.prepared = []

    def __call__(self, request, prepared) -> None:
        self.prepared.append(prepared)
        tools, messages = getattr(request, "tools", None), getattr(request, "messages", [])
        if not tools or not messages:
            return
        last = messages[-1]
        if last["role"] == "tool":
            text = f"</think>The tool says: {last['content']}"
        else:
            function = tools[0]["function"]
            args = "".join(f"<arg_key>{key}</arg_key><arg_value>{ARGUMENTS[key]}</arg_value>"
                           for key in function["parameters"]["required"])
            text = f"Use the tool.</think><tool_call>{function['name']}{args}</tool_call>"
        tokenizer = self.engine.tokenizer
        prepared.params.logits_processors.append(
            ScriptedOutput(tokenizer.encode(text), tokenizer.token_to_id("<|observation|>")))


@pytest.fixture(scope="module")
def base_url(tiny_dirs):
    server = start_server(tiny_dirs["embedded"], hook_type=ToolTurnHook)
    yield f"{server.url}/v1"
    server.stop()


@pytest.fixture
def example(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))

    def load(name: str):
        sys.modules.pop(name, None)
        return importlib.import_module(name)
    return load


def test_openai_chat(example, base_url):
    out = example("openai_chat").main(["--base-url", base_url])
    assert out["finish_reason"] in ("stop", "length") and out["streamed"]


def test_openai_tools(example, base_url):
    out = example("openai_tools").main(["--base-url", base_url])
    (call,) = out["tool_calls"]
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert out["answer"] == 'The tool says: ' + example("openai_tools").get_weather("Paris")


def test_responses_api(example, base_url):
    out = example("responses_api").main(["--base-url", base_url])
    assert out["second"].previous_response_id == out["first"].id
    assert out["second"].status in ("completed", "incomplete")


def test_agent_loop_runs_the_tool_and_returns_its_result(example, base_url):
    out = example("agent_loop").main(["--base-url", base_url])
    assert out["calls"] == [{"name": "calculate", "arguments": '{"expression": "17 * 23"}',
                             "output": "391"}]
    assert out["answer"] == "The tool says: 391"


def test_litellm(example, base_url):
    pytest.importorskip("litellm", reason="litellm is in the optional [examples] extra")
    out = example("litellm_chat").main(["--base-url", base_url])
    assert out["reply"].choices[0].finish_reason in ("stop", "length")


def test_lm_eval_local_completions(example, base_url, monkeypatch):
    for module in ("lm_eval", "tenacity"):
        pytest.importorskip(module, reason="lm-eval[api] is in the optional [examples] extra")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    scores = example("lm_eval_local").main(["--base-url", base_url, "--limit", "3"])
    assert 0 <= scores["acc,none"] <= 1
