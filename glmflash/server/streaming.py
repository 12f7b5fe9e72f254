"""Response plumbing shared by the endpoints: SSE framing (errors after the header become a
`data: {"error": ...}` event before `[DONE]`), collecting a request's deltas, and cancelling a
non-streaming request whose client went away."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse

from glmflash.engine.outputs import ResultCollector
from glmflash.server.async_engine import EngineFailure, RequestGroup, failure_error
from glmflash.server.errors import ApiError, internal_error

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


# Characters that JSON leaves raw but that line readers split on (Python's str.splitlines, as
# httpx's `aiter_lines` does): escaped, so that generated text holding one cannot cut a `data:`
# line in two for such a client. Any JSON parser reads the escapes back as the same characters.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse_event(payload: dict[str, Any], *, is_named: bool = False) -> bytes:
    """One SSE frame; `is_named` adds an `event:` line naming the payload's type (the Responses
    API's framing; an error payload is the `error` event)."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)
    if is_named:
        return f"event: {payload.get('type', 'error')}\ndata: {text}\n\n".encode()
    return f"data: {text}\n\n".encode()


async def _sse_frames(events: AsyncIterator[dict[str, Any]],
                      is_named: bool) -> AsyncIterator[bytes]:
    try:
        async for payload in events:
            yield sse_event(payload, is_named=is_named)
    except ApiError as exc:
        yield sse_event(exc.body(), is_named=is_named)
    except EngineFailure as exc:
        yield sse_event(failure_error(exc).body(), is_named=is_named)
    except Exception:
        logger.exception("stream failed")
        yield sse_event(internal_error().body(), is_named=is_named)
    if not is_named:
        yield DONE


def sse_response(events: AsyncIterator[dict[str, Any]], on_close: Callable[[], None], *,
                 is_named: bool = False) -> StreamingResponse:
    """A client disconnect cancels the stream; `on_close` runs after it in every case (it aborts
    the request if it is still running, even when the stream never started). Named streams
    (the Responses API) end with their last event instead of `data: [DONE]`."""
    return StreamingResponse(_sse_frames(events, is_named), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                             background=BackgroundTask(on_close))


async def collect(group: RequestGroup, num_prompts: int, n: int) -> list[ResultCollector]:
    """All deltas of a request, folded per prompt; the group is aborted if this is cancelled."""
    collectors = [ResultCollector(rid, [], n) for rid in group.request_ids]
    assert len(collectors) == num_prompts
    async with group:
        async for prompt_index, delta in group:
            collectors[prompt_index].add(delta)
    return collectors


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientDisconnected


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
