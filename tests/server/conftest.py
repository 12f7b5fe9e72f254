"""Live servers on 127.0.0.1 (uvicorn in a thread) over the tiny checkpoint, and the scripted
request hook that makes the random model "say" a chosen text."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import openai
import pytest
import uvicorn

from glmflash import Engine
from glmflash.server.app import create_app
from glmflash.server.state import PreparedRequest, ServerConfig
from tests.engine.scripted import ScriptedOutput

MODEL = "glm-test"
API_KEY = "sk-test"
CONTEXT_LENGTH = 1024


def _fail_at_second_token(output_ids: list[int], logits):
    if output_ids:
        raise RuntimeError("scripted engine failure")
    return logits


class ScriptHook:
    """Test-only request hook, driven by the last user message or tool result of a chat request
    (or the first prompt of a completion request):

    * `SCRIPT:<text>`: the model outputs `<text>` then `<|observation|>` (a stop token);
    * `PREFIX:<text>`: the model outputs `<text>`, then continues freely;
    * `RAISE:`: the hook raises (an internal error before any response);
    * `FAIL:`: the engine step fails at the second token (an error mid-generation).

    Every prepared request is remembered in `prepared`.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.prepared: list[PreparedRequest] = []

    def __call__(self, request, prepared: PreparedRequest) -> None:
        self.prepared.append(prepared)
        command, _, text = self._last_user_text(request).partition(":")
        tokenizer = self.engine.tokenizer
        processors = prepared.params.logits_processors
        if command == "SCRIPT":
            eos = tokenizer.token_to_id("<|observation|>")
            processors.append(ScriptedOutput(tokenizer.encode(text), eos))
        elif command == "PREFIX":
            processors.append(ScriptedOutput(tokenizer.encode(text)))
        elif command == "RAISE":
            raise RuntimeError("scripted hook failure")
        elif command == "FAIL":
            processors.append(_fail_at_second_token)

    @staticmethod
    def _last_user_text(request) -> str:
        """The last user or tool message of a chat request; a completion's first text prompt."""
        prompts = getattr(request, "prompts", None)
        if prompts:
            return prompts[0] if isinstance(prompts[0], str) else ""
        turns = [m for m in getattr(request, "messages", []) if m["role"] in ("user", "tool")]
        content = turns[-1]["content"] if turns else None
        return content if isinstance(content, str) else ""


@dataclass
class LiveServer:
    engine: Engine
    hook: ScriptHook
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def app_state(self):
        return self.server.config.app.state.server

    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        kwargs.setdefault("api_key", "unused")
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=60, **kwargs)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until no choice is in flight and every cache page is free again."""
        deadline = time.monotonic() + timeout
        cache = self.engine.cache
        while self.engine.num_pending or cache.num_free_pages != cache.plan.num_pages:
            assert time.monotonic() < deadline, "requests still hold the cache"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.engine.shutdown()


def start_server(tiny_dir, *, api_key: str | None = None, graceful_shutdown_timeout_s: float = 30,
                 hook_type: type = ScriptHook, **engine_options) -> LiveServer:
    engine_options.setdefault("context_length", CONTEXT_LENGTH)
    engine = Engine(tiny_dir, device="cpu", dtype="float32", **engine_options)
    hook = hook_type(engine)
    config = ServerConfig((MODEL, "alias"), api_key=api_key,
                          graceful_shutdown_timeout_s=graceful_shutdown_timeout_s)
    app = create_app(engine, config, request_hook=hook)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    return LiveServer(engine, hook, f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)


@pytest.fixture(scope="session")
def live(tiny_dirs):
    server = start_server(tiny_dirs["embedded"])
    yield server
    server.stop()


@pytest.fixture(scope="session")
def strict_live(tiny_dirs):
    """An API key and room for one choice in flight."""
    server = start_server(tiny_dirs["embedded"], api_key=API_KEY, max_queued_requests=1)
    yield server
    server.stop()


@pytest.fixture
def client(live) -> openai.OpenAI:
    return live.client()


def recording_exits(server: LiveServer) -> list[int]:
    """The server's requests to exit the process, recorded instead of carried out."""
    exits: list[int] = []
    server.app_state.lifecycle.request_exit = lambda: exits.append(1)
    return exits
