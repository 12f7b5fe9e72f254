"""Every GLMFLASH_* environment variable, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where the embedded tiny checkpoint is made once (GLMFLASH_CACHE_DIR, else ~/.cache)."""
    root = os.environ.get("GLMFLASH_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "glmflash"


def kernel_override(op: str) -> str | None:
    """GLMFLASH_KERNEL_<OP>=ref|triton|numba forces one implementation of an op."""
    value = os.environ.get(f"GLMFLASH_KERNEL_{op.upper()}")
    return value.lower() if value else None


def cpu_moe_decode() -> str | None:
    """GLMFLASH_CPU_MOE_DECODE=fp16|fp32-bits forces the CPU expert kernel's e4m3 decode."""
    value = os.environ.get("GLMFLASH_CPU_MOE_DECODE")
    return value.lower() if value else None


def log_level() -> str:
    return os.environ.get("GLMFLASH_LOG_LEVEL", "INFO").upper()


def configure_openmp() -> None:
    """Let torch's and numba's OpenMP runtimes stop spinning soon after a parallel region.

    Both load their own runtime; with the default spin policy their idle threads keep the
    cores the other needs busy (the CPU expert kernel fell from ~28 to ~4 GB/s). Must run before
    torch is imported; a value the user set is kept.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def dist_timeout_s() -> float:
    """GLMFLASH_DIST_TIMEOUT_S: how long a rank waits in a collective (or for the others to
    join) before it gives up; a rank that exits ends the others' wait at once on gloo."""
    return float(os.environ.get("GLMFLASH_DIST_TIMEOUT_S", "600"))


def test_fault() -> str | None:
    """GLMFLASH_TEST_FAULT="<rank>:<point>": that rank raises there (tests of rank failure)."""
    return os.environ.get("GLMFLASH_TEST_FAULT") or None
