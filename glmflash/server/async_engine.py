"""The bridge between the event loop and the engine thread.

`AsyncEngine.submit` hands a request's prompts to `Engine.add_request`, so a full queue, a bad
prompt or bad media fail before any response header is sent (a request with media is added from
a worker thread: the engine fetches and preprocesses them on the caller's thread). It returns a
`RequestGroup`: an async iterator over the choices' StreamDeltas, fed through one asyncio.Queue
by the engine thread. Leaving the group's `async with` block early (client disconnect, error,
cancellation) aborts every request still running, which frees its cache pages and state slot.
`fail_open` ends every open group with an error (shutdown past its grace period, or a dead
engine).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from glmflash.engine.errors import EngineDead, EngineOverloaded, MediaError
from glmflash.engine.multimodal import MediaSources
from glmflash.engine.outputs import StreamDelta
from glmflash.sampling_params import SamplingParams
from glmflash.server.errors import ApiError, bad_request, internal_error, overloaded, unavailable
from glmflash.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine

logger = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine ended a choice with an error (a failed step)."""


class EngineUnavailable(EngineFailure):
    """The server stopped a request: it is shutting down, or the engine has died."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


MEDIA_WORKERS = 8
"""Threads that fetch and prepare requests' media: their own pool, so that slow media hosts
(up to the fetch timeout each) cannot take the threads other requests render prompts on."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = ServerMetrics(engine)
        self.is_closed = False
        self.media_pool = ThreadPoolExecutor(MEDIA_WORKERS, thread_name_prefix="glmflash-media")
        self._ids = itertools.count()
        self.open_groups: set[RequestGroup] = set()

    @property
    def supports_media(self) -> bool:
        return self.engine.supports_media

    async def submit(self, prompts: list[list[int]],
                     params: SamplingParams | Callable[[list[int]], SamplingParams], n: int,
                     prefix: str, media: MediaSources | None = None) -> RequestGroup:
        """Queue one engine request of `n` choices per prompt (`media`: the one prompt's images
        or video; `params` may then be made from the expanded prompt, see Engine.add_request)."""
        if self.is_closed:
            raise unavailable("The server is shutting down.", "shutting_down")
        assert media is None or len(prompts) == 1
        group = RequestGroup(self, asyncio.get_running_loop(), len(prompts) * n)
        base = f"{prefix}-{next(self._ids)}"
        try:
            for index, prompt in enumerate(prompts):
                add = functools.partial(self.engine.add_request, prompt, params,
                                        group.sink(index), request_id=f"{base}-{index}", n=n,
                                        media=media)
                rid = add() if media is None else \
                    await _off_loop(add, self.engine.abort, self.media_pool)
                group.request_ids.append(rid)
        except MediaError as exc:
            group.abort()
            raise bad_request(str(exc), param="messages", code="invalid_media") from exc
        except EngineOverloaded as exc:
            group.abort()
            raise overloaded() from exc
        except EngineDead as exc:
            group.abort()
            raise unavailable(str(exc), "engine_dead") from exc
        except ValueError as exc:
            group.abort()
            raise bad_request(str(exc), param="prompt") from exc
        self.open_groups.add(group)
        return group

    def fail_open(self, failure: EngineUnavailable) -> None:
        """End every open request with `failure` (on the event loop)."""
        for group in list(self.open_groups):
            group.fail(failure)

    def shutdown(self) -> None:
        self.is_closed = True
        self.media_pool.shutdown(wait=False, cancel_futures=True)
        self.engine.shutdown()


class RequestGroup:
    """The StreamDeltas of one HTTP request's choices, as `(prompt_index, delta)` pairs."""

    def __init__(self, bridge: AsyncEngine, loop: asyncio.AbstractEventLoop,
                 num_choices: int) -> None:
        self.bridge = bridge
        self.loop = loop
        self.request_ids: list[str] = []
        self.num_open = num_choices
        self._queue: asyncio.Queue[tuple[int, StreamDelta | EngineFailure]] = asyncio.Queue()
        self._submitted_at = time.perf_counter()
        self._last_token_at: dict[tuple[int, int], float] = {}

    def sink(self, prompt_index: int):
        """The callback the engine thread calls with each delta of this prompt's choices."""
        def put(delta: StreamDelta) -> None:
            try:
                self.loop.call_soon_threadsafe(self._queue.put_nowait, (prompt_index, delta))
            except RuntimeError:
                # The event loop is closed (server shutdown): nobody is listening any more.
                logger.debug("dropping a delta of %s: event loop closed", delta.request_id)
        return put

    async def __aenter__(self) -> RequestGroup:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Abort whatever is still running (a no-op once every choice has finished)."""
        self.bridge.open_groups.discard(self)
        if self.num_open:
            self.abort()

    def fail(self, failure: EngineFailure) -> None:
        """Make the consumer raise `failure` at its next delta (it then aborts the rest)."""
        self._queue.put_nowait((-1, failure))

    def abort(self) -> None:
        for request_id in self.request_ids:
            self.bridge.engine.abort(request_id)
        if self.request_ids:
            logger.debug("aborted %s", self.request_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        while self.num_open:
            prompt_index, delta = await self._queue.get()
            if isinstance(delta, EngineFailure):
                raise delta
            self._observe(prompt_index, delta)
            if delta.finish_reason == "error":
                raise EngineFailure(delta.error or "generation failed")
            yield prompt_index, delta

    def _observe(self, prompt_index: int, delta: StreamDelta) -> None:
        metrics, now = self.bridge.metrics, time.perf_counter()
        key = (prompt_index, delta.index)
        if delta.token_ids:
            last = self._last_token_at.get(key)
            if last is None:
                metrics.time_to_first_token.observe(now - self._submitted_at)
            else:
                # A speculative step's run of k tokens: k gaps of a k-th of the wait each.
                k = len(delta.token_ids)
                metrics.inter_token_latency.observe((now - last) / k, times=k)
            self._last_token_at[key] = now
        if delta.finish_reason is not None:
            self.num_open -= 1
            metrics.completion_tokens.inc(delta.num_output_tokens)
            if delta.index == 0:
                metrics.prompt_tokens.inc(delta.num_prompt_tokens)
            if not self.num_open:
                metrics.e2e_latency.observe(now - self._submitted_at)
                self.bridge.open_groups.discard(self)


async def _off_loop(add: Callable[[], str], abort: Callable[[str], None],
                    pool: ThreadPoolExecutor) -> str:
    """Run `add` in a thread of `pool`; if the caller is cancelled meanwhile (client gone), the
    request it adds is aborted as soon as it exists."""
    future = asyncio.get_running_loop().run_in_executor(pool, add)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        future.add_done_callback(
            lambda done: done.cancelled() or done.exception() or abort(done.result()))
        raise


def failure_error(exc: EngineFailure) -> ApiError:
    if isinstance(exc, EngineUnavailable):
        return unavailable(str(exc), exc.code)
    logger.error("generation failed: %s", exc)
    return internal_error(f"generation failed: {exc}")
