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


def append_results(title: str, table: str) -> None:
    """Append a dated section (device, commit) with a markdown table to bench/RESULTS.md."""
    stamp = datetime.date.today().isoformat()
    header = f"\n## {title}\n\n{stamp} · {device_description()} · commit {git_commit()}\n\n"
    with RESULTS.open("a") as f:
        f.write(header + table.rstrip() + "\n")


@contextlib.contextmanager
def restoring(module, *names: str) -> Iterator[None]:
    """Put the module's tuning constants back as they were after a sweep has changed them."""
    saved = {name: getattr(module, name) for name in names}
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def fill_fake_context(engine, prompts: list[list[int]], params, sink=lambda delta: None) -> None:
    """Submit `prompts` and make each a running sequence whose cache already holds all but its
    last token, without a prefill: pages and a state slot come from the cache manager (the
    runner's page table learns them with the next batch); the cached values are whatever the
    cache holds. The next step decodes every one of them."""
    from glmflash.engine.sequence import SequenceStatus

    for prompt in prompts:
        engine.add_request(prompt, params, sink)
    engine._drain_inbox(block=False)
    while engine.scheduler.waiting:
        seq = engine.scheduler.waiting.popleft()
        cached = seq.num_tokens - 1
        if not engine.cache.can_allocate(seq, cached):
            raise ValueError(f"no room for {cached} tokens of fake context")
        engine.cache.allocate(seq, cached)
        seq.num_computed_tokens = cached
        seq.status = SequenceStatus.RUNNING
        engine.scheduler.running.append(seq)
