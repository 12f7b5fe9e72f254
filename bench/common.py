"""Shared bits of the benchmarks: device description, git commit, appending to RESULTS.md."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def git_commit() -> str:
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
    import torch

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


@contextlib.contextmanager
def restoring(module, *names: str) -> Iterator[None]:
    """Put the module's tuning constants back as they were after a sweep has changed them."""
    saved = {name: getattr(module, name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
