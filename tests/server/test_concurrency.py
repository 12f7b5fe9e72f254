"""Many streams at once, and clients that go away mid-request (their cache must come back)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import MODEL

HI = [{"role": "user", "content": "hi"}]
LONG = {"model": MODEL, "messages": HI, "max_tokens": 600, "ignore_eos": True}


def _question(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}]


def _text(message) -> str:
    return (message.model_extra.get("reasoning_content") or "") + "|" + (message.content or "")


def test_sixteen_concurrent_streams(live):
    client = live.async_client()

    async def one(i: int) -> tuple[str, int]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=_question(i), max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reasoning, content, usage = "", "", None
        async for chunk in stream:
            if chunk.choices:
                reasoning += chunk.choices[0].delta.model_extra.get("reasoning_content") or ""
                content += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return f"{reasoning}|{content}", usage.completion_tokens

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(main())
    assert [n for _, n in results] == [8] * 16
    live.wait_idle()
    # Greedy and batched: a prompt gives the same text alone as in the crowd.
    for i in (3, 15):
        alone = live.client().chat.completions.create(
            model=MODEL, messages=_question(i), max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True})
        assert _text(alone.choices[0].message) == results[i][0]


def _wait_until_running(live, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not live.engine.scheduler.running:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_stream_disconnect_frees_the_cache(live):
    cache = live.engine.cache
    live.wait_idle()
    with httpx.stream("POST", f"{live.url}/v1/chat/completions",
                      json={**LONG, "stream": True}, timeout=30) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert all(not line or line.startswith("data: {") for line in received)
        assert cache.num_free_pages < cache.plan.num_pages
    live.wait_idle()
    assert not live.engine.scheduler.running and not live.engine.scheduler.waiting


def test_non_stream_disconnect_frees_the_cache(live):
    live.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live.url}/v1/chat/completions", json=LONG, timeout=httpx.Timeout(30, read=1))
    live.wait_idle()
    assert live.engine.num_pending == 0


def test_completion_stream_disconnect_frees_the_cache(live):
    live.wait_idle()
    body = {"model": MODEL, "prompt": ["a", "b"], "n": 2, "max_tokens": 600, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=30) as response:
        _wait_until_running(live)
        next(response.iter_lines())
    live.wait_idle()
