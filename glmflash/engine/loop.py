"""The engine thread: it drains the inbox (adds, aborts, stop) and runs steps until stopped.

A failed step ends the requests it ran; a lost device or any other BaseException stops the
engine (`fatal_error`), ending every request in flight. Mixed into `Engine`, whose state it uses.
"""

from __future__ import annotations

import logging
import queue
import threading

import torch

logger = logging.getLogger(__name__)


class EngineLoopMixin:
    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                thread = threading.Thread(target=self._loop, name="glmflash-engine", daemon=True)
                thread.start()
                # Published once alive: `failure`, read by other submitting threads, takes a
                # set but not yet started thread for a dead one.
                self._thread = thread

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.scheduler.has_work:
                    self._drain_inbox(block=True)
                if not self._stopping:
                    self._guarded_step()
            # Requests still in flight at shutdown end now and give their cache back.
            self._fail_seqs(self._live_seqs(), "the engine was shut down")
            self._publish_stats()
        except BaseException as exc:  # noqa: B036 - the thread must not end silently
            self._die(exc)

    def _guarded_step(self) -> None:
        """One step; a failed step ends the requests it was running, not the engine."""
        try:
            self.step()
        except Exception as exc:
            if is_device_lost(exc):
                raise
            batch, self._batch = self._batch, None
            logger.exception("engine step failed; ending %s", "every live request"
                             if batch is None else f"the {len(batch.seqs)} requests it ran")
            if batch is not None:
                self.cache.forget_unsaved(batch.cache_ops)
            seqs = batch.seqs if batch is not None else self._live_seqs()
            self._fail_seqs(seqs, f"{type(exc).__name__}: {exc}")
            self._publish_stats()

    def _die(self, exc: BaseException) -> None:
        self.fatal_error = f"{type(exc).__name__}: {exc}"
        logger.critical("the engine thread stopped: %s", self.fatal_error, exc_info=exc)
        try:
            self._fail_seqs(self._live_seqs(), f"the engine stopped: {self.fatal_error}")
            self._publish_stats()
        except Exception:
            logger.exception("could not end the requests in flight")

    def _drain_inbox(self, block: bool) -> None:
        try:
            message = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = message
            if kind == "add":
                self._admit(*payload)
            elif kind == "abort":
                self._abort(payload)
            elif kind == "stop":
                return
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return


def is_device_lost(exc: Exception) -> bool:
    """A CUDA error other than out-of-memory leaves the context unusable: every later step
    would fail too, so the engine stops instead of failing requests one step at a time."""
    if getattr(exc, "ends_engine", False):  # e.g. a rank of a split model failed
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(exc, accelerator_error) or "CUDA error" in str(exc)
