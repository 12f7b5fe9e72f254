"""A long prefill keeps the server responsive: /health answers between its chunks, a request
that is decoding keeps receiving tokens while the long prompt is prefilled, and the log shows
the long prefill's progress."""

from __future__ import annotations

import logging
import re
import threading
import time

import httpx
import pytest

from tests.server.conftest import MODEL, start_server

PROMPT_TOKENS = 1200
CHUNK = 64
SHORT_TOKENS = 60
# A /health answer takes milliseconds when idle; between 64-token chunks it must stay well
# below a client's patience.
HEALTH_LIMIT_S = 2.0


@pytest.fixture(scope="module")
def server(tiny_dirs):
    live = start_server(tiny_dirs["embedded"], context_length=2048, chunked_prefill_size=CHUNK,
                        max_running_requests=2)
    yield live
    live.stop()


def _long(url: str, done: dict) -> None:
    body = {"model": MODEL, "prompt": [(7 * i + 3) % 1000 for i in range(PROMPT_TOKENS)],
            "max_tokens": 1, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    done["long"] = (time.monotonic(), response.status_code)


def _short(server, arrivals: list[float]) -> None:
    stream = server.client().completions.create(
        model=MODEL, prompt="Hello", max_tokens=SHORT_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    for _ in stream:
        arrivals.append(time.monotonic())


def _wait(condition, what: str, timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)
    return time.monotonic()


def test_health_and_decodes_during_a_long_prefill(server, caplog):
    caplog.set_level(logging.INFO, logger="glmflash.engine.progress")
    done, arrivals = {}, []
    short = threading.Thread(target=_short, args=(server, arrivals))
    short.start()
    _wait(lambda: len(arrivals) >= 2, "the short request's first tokens")
    long = threading.Thread(target=_long, args=(server.url, done))
    long.start()
    running = server.engine.scheduler.running
    started = _wait(lambda: any(s.num_prompt_tokens == PROMPT_TOKENS and s.num_computed_tokens
                                for s in list(running)), "the long prefill")
    latencies = []
    while long.is_alive():
        begin = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ok"}
        latencies.append(time.monotonic() - begin)
        time.sleep(0.05)
    long.join()
    short.join()
    assert done["long"][1] == 200
    during = [t for t in arrivals if started < t < done["long"][0]]
    assert len(during) >= 5, f"{len(during)} tokens of the short request during the prefill"
    assert len(latencies) >= 5 and max(latencies) < HEALTH_LIMIT_S, latencies
    text = caplog.text
    assert f"prefilling {PROMPT_TOKENS} prompt tokens" in text
    tenths = re.findall(rf"prefill \d+ / {PROMPT_TOKENS} tokens \(\d+%\)", text)
    assert len(tenths) >= 8 and f"prefilled {PROMPT_TOKENS} tokens" in text
