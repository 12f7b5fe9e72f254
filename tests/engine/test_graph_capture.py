"""The engine's captures (glmflash/utils/graph_capture.py) are thread-local and pause garbage
collection, so another thread's unsafe call (cudaMalloc) or a collection that frees another
engine's memory cannot invalidate them; on CUDA, a capture taken while another thread keeps
allocating replays correctly, where CUDA's default mode fails. (A device-wide synchronise from
another thread breaks a capture in any mode: it waits on the capturing stream.)"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

import glmflash.utils.graph_capture as graph_capture


def test_capture_is_thread_local_and_pauses_the_collector(monkeypatch):
    seen = {}

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.update(mode=capture_error_mode, collecting=gc.isenabled(), pool=pool)
        yield

    monkeypatch.setattr(graph_capture.torch.cuda, "graph", fake_graph)
    assert gc.isenabled()
    with graph_capture.isolated_capture(object(), pool=(0, 1)):
        pass
    assert seen == {"mode": "thread_local", "collecting": False, "pool": (0, 1)}
    assert gc.isenabled()
    with pytest.raises(ValueError), graph_capture.isolated_capture(object()):
        raise ValueError("a failed capture")
    assert gc.isenabled()


def _capture_beside_an_allocating_thread(capture):
    """Capture a forward of 200 small kernels with `capture(forward)` while another thread
    allocates new device memory (cudaMalloc: an unsafe call during a capture) in the middle of
    it; then replay the graph on new input and compare with eager."""
    device = torch.device("cuda")
    x = torch.arange(1024, dtype=torch.float32, device=device)
    capturing, allocated = threading.Event(), threading.Event()
    kept = []

    def allocate_during_the_capture():
        capturing.wait(timeout=60)
        for _ in range(8):
            try:  # the call may itself be refused while the capture runs: it is made anyway
                kept.append(torch.empty(2**21, dtype=torch.uint8, device=device))
            except RuntimeError:
                pass
        allocated.set()

    def forward():
        y = x * 1.0001 + 1
        if torch.cuda.is_current_stream_capturing():
            capturing.set()
            assert allocated.wait(timeout=60), "the other thread did not allocate"
        for _ in range(199):
            y = y * 1.0001 + 1
        return (y,)

    other = threading.Thread(target=allocate_during_the_capture, daemon=True)
    other.start()
    try:
        graph, (out,) = capture(forward)
    finally:
        capturing.set()
        other.join()
    x.add_(1)
    graph.replay()
    torch.testing.assert_close(out, forward()[0])


def _global_capture(forward):
    forward()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = forward()
    return graph, outputs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_capture_survives_another_thread_allocating():
    _capture_beside_an_allocating_thread(
        lambda forward: graph_capture.record(forward, None, torch.device("cuda")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_global_capture_does_not():
    """What the isolation is for: the same capture in CUDA's default mode fails."""
    try:
        with pytest.raises(RuntimeError, match="captur"):
            _capture_beside_an_allocating_thread(_global_capture)
    finally:
        _end_generator_capture()


def _end_generator_capture() -> None:
    """A failed capture leaves the default CUDA generator marked as capturing (PyTorch ends
    its capture only when the capture itself ends well), and every later random draw on the
    device then raises "Offset increment outside graph capture". A capture that ends well
    clears the mark for the tests that run after this one in the process."""
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    torch.randint(0, 2, (1,), device="cuda")  # raises if the mark were still there


def test_nested_captures_restore_the_collector_after_the_last(monkeypatch):
    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        yield

    monkeypatch.setattr(graph_capture.torch.cuda, "graph", fake_graph)
    first = graph_capture.isolated_capture(object())
    second = graph_capture.isolated_capture(object())
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second capture still runs
    second.__exit__(None, None, None)
    assert gc.isenabled()
