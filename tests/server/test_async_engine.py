"""The bridge's worker-thread submission (requests with media): a caller cancelled while the
engine prepares the media leaves no request running."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from glmflash.server.async_engine import _off_loop


def test_a_cancelled_submission_aborts_the_request_it_adds():
    started, release = threading.Event(), threading.Event()
    aborted: list[str] = []

    def add() -> str:
        started.set()
        release.wait(5)
        return "req-7"

    async def main() -> None:
        task = asyncio.ensure_future(_off_loop(add, aborted.append, ThreadPoolExecutor(1)))
        await asyncio.to_thread(started.wait, 5)
        task.cancel()
        release.set()
        try:
            await task
        except asyncio.CancelledError:
            pass
        for _ in range(100):
            if aborted:
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert aborted == ["req-7"]


def test_a_submission_that_completes_returns_its_request_id():
    async def main() -> str:
        return await _off_loop(lambda: "req-1", lambda rid: None, ThreadPoolExecutor(1))

    assert asyncio.run(main()) == "req-1"


def test_media_submissions_wait_in_their_own_pool():
    """Submissions with media (fetches up to a timeout each) hold threads of the media pool
    only: while every one of them is busy, the loop's default pool still runs other work."""
    from glmflash.server.async_engine import MEDIA_WORKERS

    pool, release = ThreadPoolExecutor(MEDIA_WORKERS), threading.Event()

    async def main() -> bool:
        slow = [asyncio.ensure_future(_off_loop(lambda: release.wait(10) and "r",
                                                lambda rid: None, pool))
                for _ in range(4 * MEDIA_WORKERS)]
        await asyncio.sleep(0.05)
        rendered = await asyncio.wait_for(asyncio.to_thread(lambda: True), 2)
        release.set()
        await asyncio.gather(*slow)
        return rendered

    assert asyncio.run(main())


class _IdleEngine:
    """What AsyncEngine reads of an engine to build its metrics (speculative decoding off)."""

    def stats(self):
        from glmflash.engine.cache import PrefixCacheStats
        from glmflash.engine.outputs import EngineStats

        fields = PrefixCacheStats.__dataclass_fields__
        return EngineStats(0, 0, 1, 1, PrefixCacheStats(*([0] * len(fields))), None)


def test_inter_token_latency_counts_every_token_of_a_run(monkeypatch):
    """A speculative step's delta brings several tokens: the histogram takes one gap per
    token (each the k-th of the wait), so its sum is the time and its count the gaps."""
    from glmflash.engine.outputs import StreamDelta
    from glmflash.server import async_engine

    # submitted, the first token 1 s later, a run of 3 tokens 3/32 s on, one token 1/32 s on
    clock = iter([0.0, 1.0, 1.09375, 1.125])
    monkeypatch.setattr(async_engine.time, "perf_counter", lambda: next(clock))

    async def stream():
        bridge = async_engine.AsyncEngine(_IdleEngine())
        group = async_engine.RequestGroup(bridge, asyncio.get_running_loop(), 1)
        for text, tokens in (("a", [1]), ("bcd", [2, 3, 4]), ("e", [5])):
            group._observe(0, StreamDelta("r", 0, text, tokens))
        return bridge.metrics.inter_token_latency

    latency = asyncio.run(stream())
    assert latency.count == 4 and latency.sum == 0.125
    assert latency.counts[latency.buckets.index(0.05)] == 4  # four gaps of 1/32 s
