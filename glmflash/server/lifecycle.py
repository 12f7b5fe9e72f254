"""The server's life after start: draining on SIGINT/SIGTERM, the shutdown deadline, a dead
engine, and the process exit status.

On the first signal the server stops admitting requests (503 `shutting_down`, /health 503) and
uvicorn stops accepting connections; running requests may finish for `graceful_timeout_s`, then
each still open gets an error event and `[DONE]` (a non-streaming one a 503). A second signal ends
them at once. A dead engine thread makes /health answer 503, ends the open requests and exits
with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING

import uvicorn

from glmflash.server.args import DEFAULT_GRACEFUL_TIMEOUT_S
from glmflash.server.async_engine import EngineUnavailable

if TYPE_CHECKING:
    from types import FrameType

    from glmflash.server.async_engine import AsyncEngine

logger = logging.getLogger(__name__)
# How often the event loop checks that the engine thread is alive.
ENGINE_WATCH_INTERVAL_S = 0.25
# uvicorn cancels connections still open this long after our own deadline (a backstop only).
_UVICORN_MARGIN_S = 5.0
# Idle keep-alive connections stay open this long: longer than clients keep them (httpx, and so
# the openai SDK, expire theirs after 5 s). With uvicorn's default, also 5 s, a client could send
# on a connection at the moment the server closed it, and that request failed (a read error).
KEEP_ALIVE_S = 75
SHUTTING_DOWN = "The server is shutting down; this request was stopped before it finished."


class Lifecycle:
    """Draining, the shutdown deadline, engine death and the exit status of one server."""

    def __init__(self, bridge: AsyncEngine,
                 graceful_timeout_s: float = DEFAULT_GRACEFUL_TIMEOUT_S) -> None:
        self.bridge = bridge
        self.graceful_timeout_s = graceful_timeout_s
        self.is_draining = False
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None
        """Set by the launcher: makes uvicorn stop accepting connections and wind down."""
        self._deadline: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The server's event loop, once it runs (begin_shutdown must run on it)."""

    def begin_shutdown(self) -> None:
        """First call: stop admitting and start the grace period; second call: end now."""
        if self.is_draining:
            logger.warning("second signal: stopping the requests still running")
            self._expire()
            return
        self.is_draining = True
        num_open = len(self.bridge.open_groups)
        logger.info("shutting down: no new requests; %d running may finish within %g s",
                    num_open, self.graceful_timeout_s)
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self.graceful_timeout_s, self._expire)
        self.request_exit()

    def _expire(self) -> None:
        if self.bridge.open_groups:
            logger.warning("grace period over: ending %d running request(s) with an error",
                           len(self.bridge.open_groups))
        self.bridge.is_closed = True
        self.bridge.fail_open(EngineUnavailable(SHUTTING_DOWN, "shutting_down"))

    def on_engine_failure(self, error: str) -> None:
        logger.critical("the engine has stopped (%s); the server exits", error)
        self.exit_code = 1
        self.is_draining = True
        self.bridge.fail_open(EngineUnavailable(f"The engine has stopped: {error}",
                                                "engine_dead"))
        self.request_exit()

    async def watch_engine(self) -> None:
        """Poll the engine thread; on its death, fail what is open and ask the server to exit."""
        self.loop = asyncio.get_running_loop()
        while True:
            error = self.bridge.engine.failure
            if error is not None:
                self.on_engine_failure(error)
                return
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()


class GracefulServer(uvicorn.Server):
    """uvicorn with our signal handling: the first SIGINT/SIGTERM drains (see `Lifecycle`), the
    second ends the running requests; signals are not re-raised after the server stops, so the
    process exits with `Lifecycle.exit_code` and no traceback."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.request_exit = self._request_exit

    @staticmethod
    def config(app, lifecycle: Lifecycle, log_level: str) -> uvicorn.Config:
        return uvicorn.Config(app, log_level=log_level, timeout_keep_alive=KEEP_ALIVE_S,
                              timeout_graceful_shutdown=int(lifecycle.graceful_timeout_s
                                                            + _UVICORN_MARGIN_S))

    def _request_exit(self) -> None:
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: a signal handler runs between two bytecodes of the loop's thread; the work is
        # queued onto the loop rather than done here.
        logger.info("received %s", signal.Signals(sig).name)
        try:
            asyncio.get_running_loop().call_soon_threadsafe(self.lifecycle.begin_shutdown)
        except RuntimeError:
            self.should_exit = True
