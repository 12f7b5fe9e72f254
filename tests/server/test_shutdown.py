"""SIGINT/SIGTERM: no new requests, running streams finish within --graceful-shutdown-timeout or
end with an error event and [DONE], no traceback, exit status 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, recording_exits, start_server
from tests.server.test_serve_cli import _free_port

HI = [{"role": "user", "content": "hi"}]


def _stream(url: str, max_tokens: int, out: dict, key: str) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        out[key] = [line for line in response.iter_lines() if line]


def _wait_running(engine_running, count: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while engine_running() < count:
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.02)


@pytest.fixture
def draining(tiny_dirs):
    server = start_server(tiny_dirs["embedded"], graceful_shutdown_timeout_s=1.5)
    yield server, recording_exits(server)
    server.stop()


def test_draining_refuses_new_requests_and_ends_the_rest_after_the_grace(draining):
    server, exits = draining
    out: dict = {}
    thread = threading.Thread(target=_stream, args=(server.url, 900, out, "long"))
    thread.start()
    _wait_running(lambda: len(server.engine.scheduler.running), 1)
    lifecycle = server.app_state.lifecycle
    lifecycle.loop.call_soon_threadsafe(lifecycle.begin_shutdown)
    time.sleep(0.2)
    assert exits == [1]
    assert httpx.get(f"{server.url}/health").status_code == 503
    refused = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    thread.join(30)
    events = out["long"]
    assert events[-1] == "data: [DONE]" and '"code":"shutting_down"' in events[-2]
    server.wait_idle()


def test_sigterm_lets_short_streams_finish_and_ends_long_ones(tiny_dirs, tmp_path):
    port = _free_port()
    log = (tmp_path / "serve.log").open("w+")
    cmd = [sys.executable, "-m", "glmflash.cli", "serve", "--model-path",
           str(tiny_dirs["embedded"]), "--port", str(port), "--served-model-name", MODEL,
           "--graceful-shutdown-timeout", "3"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        out: dict = {}
        threads = [threading.Thread(target=_stream, args=(url, n, out, key))
                   for key, n in (("short", 12), ("long", 6000))]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    text = log.read()
    assert "Traceback" not in text and "CancelledError" not in text, text
    assert out["short"][-1] == "data: [DONE]" and '"finish_reason":"length"' in out["short"][-2]
    assert out["long"][-1] == "data: [DONE]" and '"code":"shutting_down"' in out["long"][-2]
    assert "received SIGTERM" in text and "cache integrity after shutdown: ok" in text


def test_idle_connections_outlive_the_clients_keep_alive():
    # A server that closed idle connections no later than httpx (and the openai SDK) expires
    # them could close one just as a client sends on it: that request would fail.
    from types import SimpleNamespace

    from glmflash.server.lifecycle import GracefulServer

    config = GracefulServer.config(object(), SimpleNamespace(graceful_timeout_s=1.0), "warning")
    assert config.timeout_keep_alive > httpx.Limits().keepalive_expiry
