"""One bad request harms nobody else: hostile sampling values are 400s naming the field while
three streams run on, and a dead engine makes /health say so and the server exit non-zero."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, recording_exits, start_server

HI = [{"role": "user", "content": "hi"}]
NAN, INF = float("nan"), float("inf")
BAD_FIELDS = [
    ({"seed": 2**70, "temperature": 1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"logit_bias": {"5": NAN}}, "logit_bias.5"),
    ({"logit_bias": {"5": INF}}, "logit_bias.5"),
    ({"logit_bias": {"²": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"temperature": NAN}, "temperature"),
    ({"top_p": NAN}, "top_p"),
    ({"min_p": NAN}, "min_p"),
    ({"repetition_penalty": NAN}, "repetition_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"frequency_penalty": -INF}, "frequency_penalty"),
    ({"temperature": 10**400}, "temperature"),
    ({"top_k": 2**70}, "top_k"),
]


def _raw_post(url: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN / Infinity literals, which Python's JSON reader (and ours) accepts.
    return httpx.post(f"{url}/v1/chat/completions", content=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=30)


def _stream(url: str, out: list, index: int) -> None:
    body = {"model": MODEL, "messages": HI, "max_tokens": 40, "ignore_eos": True, "stream": True,
            "temperature": 1, "seed": index}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
        out[index] = (response.status_code, [line for line in response.iter_lines() if line])


def test_hostile_values_are_400s_beside_three_live_streams(live):
    results: list = [None] * 3
    threads = [threading.Thread(target=_stream, args=(live.url, results, i)) for i in range(3)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(live.engine.scheduler.running) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    for fields, param in BAD_FIELDS:
        for stream in (False, True):
            response = _raw_post(live.url, {"model": MODEL, "messages": HI, "max_tokens": 4,
                                            "stream": stream, **fields})
            assert response.status_code == 400, (fields, response.text)
            assert response.json()["error"]["param"] == param
    for thread in threads:
        thread.join(120)
    for status, events in results:
        assert status == 200 and events[-1] == "data: [DONE]"
        assert not any('"error"' in e for e in events)
        assert '"finish_reason":"length"' in events[-2]
    live.wait_idle()


@pytest.fixture
def doomed(tiny_dirs):
    server = start_server(tiny_dirs["embedded"])
    yield server, recording_exits(server)
    server.stop()


def test_a_dead_engine_fails_health_requests_and_the_exit_status(doomed):
    server, exits = doomed
    assert httpx.get(f"{server.url}/health").status_code == 200
    run = server.engine.runner.run
    calls = [0]

    def run_then_die(batch):
        calls[0] += 1
        if calls[0] > 3:
            raise SystemExit("simulated thread death")
        return run(batch)
    server.engine.runner.run = run_then_die
    body = {"model": MODEL, "messages": HI, "max_tokens": 50, "ignore_eos": True, "stream": True}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and "engine stopped" in events[-2]
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    assert exits and server.app_state.lifecycle.exit_code == 1
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 503 and "SystemExit" in health.json()["error"]
    again = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "stream": False})
    assert again.status_code == 503 and again.json()["error"]["code"] == "shutting_down"


def test_serve_returns_exit_status_1_when_the_engine_dies(tiny_dirs):
    from glmflash import Engine
    from glmflash.server.launch import bind_socket, serve
    from glmflash.server.state import ServerConfig

    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=256)
    sock = bind_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    status: list[int] = []
    thread = threading.Thread(target=lambda: status.append(
        serve(engine, ServerConfig((MODEL,)), sock, log_level="warning")))
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def die(batch):
        raise SystemExit("simulated thread death")
    engine.runner.run = die
    response = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": HI, "max_tokens": 3})
    assert response.status_code == 500 and "engine stopped" in response.text
    thread.join(30)
    assert status == [1]
