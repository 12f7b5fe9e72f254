"""CUDA graph capture that less in the process can spoil.

A capture in CUDA's default ("global") mode is invalidated by an unsafe call (a cudaMalloc, say)
from any thread, and a garbage collection that runs inside it can free another object's pinned
memory or graphs in the middle of the capture; the error then surfaces at some later launch of
the captured forward. Here the capture is thread-local (the capturing thread's own calls are
still checked) and the collector is paused for its duration. A device-wide synchronise from
another thread still breaks it, in any mode."""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator

import torch


class _CollectorPause:
    """Garbage collection off while any capture runs (captures of several threads nest: the
    collector comes back when the last ends, if it was on before the first)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.was_enabled = False

    def __enter__(self) -> None:
        with self.lock:
            if self.depth == 0:
                self.was_enabled = gc.isenabled()
                gc.disable()
            self.depth += 1

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth == 0 and self.was_enabled:
                gc.enable()


_COLLECTOR_PAUSE = _CollectorPause()


@contextlib.contextmanager
def isolated_capture(graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None = None
                     ) -> Iterator[None]:
    """`torch.cuda.graph(graph, pool)`, thread-local, with garbage collection paused."""
    with _COLLECTOR_PAUSE, torch.cuda.graph(graph, pool=pool,
                                            capture_error_mode="thread_local"):
        yield


def record(forward: Callable[[], tuple[torch.Tensor, ...]], pool: tuple[int, int] | None,
           device: torch.device, warmups: int = 2
           ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    """Run `forward` `warmups` times on a side stream (compiles kernels, fits launch shapes),
    then capture it: the graph and the outputs its replays rewrite. Both under inference mode,
    as the model's own forward (the CPU experts' hand-off buffers are inference tensors)."""
    with torch.inference_mode():
        return _warm_and_capture(forward, pool, device, warmups)


def _warm_and_capture(forward: Callable[[], tuple[torch.Tensor, ...]],
                      pool: tuple[int, int] | None, device: torch.device, warmups: int
                      ) -> tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]:
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            forward()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with isolated_capture(graph, pool):
        outputs = forward()
    return graph, outputs
