"""Shared bits of the benchmarks: timing (event-timed and CUDA-graph replays, L2 defeated by
rotating buffers), tables, device description, git commit, appending to RESULTS.md."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

import torch

RESULTS = Path(__file__).with_name("RESULTS.md")


def bench_ms(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median ms of `fn` (triton.testing.do_bench, event-timed)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def event_ms(fn, reps: int = 5) -> float:
    """Median ms of `fn` over `reps` event-timed calls after one warm-up call: for calls of
    several ms that cannot be captured in a CUDA graph (host reads) and that do_bench's
    time-based repetition would run only once."""
    import statistics

    fn()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


L2_DEFEAT_BYTES = 512 << 20  # several times the H200's L2, so replays read HBM


def graph_ms(fn, rep: int = 100) -> float:
    """Median ms of `fn` replayed from a CUDA graph: the kernels alone, without the Python launch
    cost that hides them at decode sizes (the engine's decode step is graph-shaped too).
    `fn` may be a list of calls on different buffers (see `copies`); the time is per call."""
    import triton

    fns = fn if isinstance(fn, list) else [fn]
    for f in fns:
        f()  # build host-side caches (metadata tensors) before capture
    torch.cuda.synchronize()
    ms = triton.testing.do_bench_cudagraph(lambda: [f() for f in fns], rep=rep,
                                           return_mode="median")
    return ms / len(fns)


def copies(bytes_per_call: int) -> int:
    """Calls on distinct buffers per timed replay, so the data of one call is out of L2 by the
    time it comes round again (34 layers each have their own state in the model)."""
    return max(1, min(64, -(-L2_DEFEAT_BYTES // max(bytes_per_call, 1))))


def rotated(t: torch.Tensor) -> list[torch.Tensor]:
    """`t` and enough clones of it that replays cycling through them read HBM, not L2."""
    return [t] + [t.clone() for _ in range(copies(t.numel() * t.element_size()) - 1)]


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (GB/s)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup=5, rep=50)
    return 2 * (2 << 30) / ms / 1e6


def bf16_peak_tflops() -> float:
    """A large bf16 matrix product (torch, cuBLAS): the tensor throughput rooflines divide by."""
    n = 8192
    a = torch.randn(n, n, device="cuda").bfloat16()
    b = torch.randn(n, n, device="cuda").bfloat16()
    ms = bench_ms(lambda: a @ b, warmup=5, rep=50)
    return 2 * n ** 3 / ms / 1e9


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def git_commit() -> str:
    """The commit measured: GLMFLASH_COMMIT when set (a copied tree's git metadata may be older
    than its files), else the checkout's HEAD."""
    if os.environ.get("GLMFLASH_COMMIT"):
        return os.environ["GLMFLASH_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GLMFLASH_COMMIT", "unknown")


def cpu_description() -> str:
    model = platform.processor() or "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def device_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (+ {cpu_description()})"
    return cpu_description()


def results_section(title: str, table: str) -> str:
    """A dated markdown section (device, commit) holding `table`, as RESULTS.md keeps them."""
    stamp = datetime.date.today().isoformat()
    header = f"\n## {title}\n\n{stamp} · {device_description()} · commit {git_commit()}\n\n"
    return header + table.rstrip() + "\n"


def append_results(title: str, table: str) -> None:
    """Append a dated section (device, commit) with a markdown table to bench/RESULTS.md."""
    with RESULTS.open("a") as f:
        f.write(results_section(title, table))


def fill_fake_context(engine, seq, num_tokens: int) -> None:
    """Make the waiting `seq` running with its first `num_tokens` tokens counted as computed.

    Its pages and state slot come from the engine's CacheManager as a prefill would take them,
    but hold whatever is there (zeros or earlier sequences' values): the next step is a pure
    decode over a context of `num_tokens` tokens, without prefilling them. For timing only.
    """
    from glmflash.engine.sequence import SequenceStatus

    scheduler, cache = engine.scheduler, engine.cache
    if seq not in scheduler.waiting or seq.num_computed_tokens:
        raise ValueError(f"sequence {seq.seq_id} is not a fresh waiting sequence")
    if not 0 < num_tokens < seq.num_tokens:
        raise ValueError(f"fake context of {num_tokens} tokens must leave at least one of the "
                         f"{seq.num_tokens} tokens to decode")
    if len(scheduler.running) >= scheduler.config.max_running_requests or \
            not cache.can_allocate(seq, num_tokens):
        raise RuntimeError(f"no room for a context of {num_tokens} tokens: raise "
                           "max_running_requests, context_length or the cache budget")
    scheduler.waiting.remove(seq)
    cache.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    seq.status = SequenceStatus.RUNNING
    scheduler.running.append(seq)


def add_fake_context_requests(engine, num_requests: int, context_len: int, params) -> list:
    """Add `num_requests` requests of `context_len + 1` prompt tokens whose first `context_len`
    tokens are faked (`fill_fake_context`): the next `engine.step()` decodes all of them."""
    known = {seq.seq_id for seq in engine.scheduler.waiting}
    for i in range(num_requests):
        engine.add_request([1 + (i + j) % 997 for j in range(context_len + 1)], params,
                           lambda delta: None)
    # NOTE: moves the submissions into the scheduler's waiting queue without running a step.
    engine._drain_inbox(block=False)
    seqs = [seq for seq in engine.scheduler.waiting if seq.seq_id not in known]
    assert len(seqs) == num_requests
    for seq in seqs:
        fill_fake_context(engine, seq, context_len)
    return seqs


def kernel_ms(fn, reps: int = 3) -> dict[str, float]:
    """GPU ms per call of each kernel `fn` launches (torch.profiler, after one warm-up call),
    summed by kernel name, in launch order."""
    from torch.autograd import DeviceType

    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            us = e.time_range.end - e.time_range.start
            out[e.name] = out.get(e.name, 0.0) + us / 1e3 / reps
    return out
