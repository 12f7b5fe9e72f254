"""The bridge's worker-thread submission (requests with media): a caller cancelled while the
engine prepares the media leaves no request running."""

from __future__ import annotations

import asyncio
import threading

from glmflash.server.async_engine import _off_loop


def test_a_cancelled_submission_aborts_the_request_it_adds():
    started, release = threading.Event(), threading.Event()
    aborted: list[str] = []

    def add() -> str:
        started.set()
        release.wait(5)
        return "req-7"

    async def main() -> None:
        task = asyncio.ensure_future(_off_loop(add, aborted.append))
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
        return await _off_loop(lambda: "req-1", lambda rid: None)

    assert asyncio.run(main()) == "req-1"
