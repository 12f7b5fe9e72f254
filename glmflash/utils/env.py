"""Every GLMFLASH_* environment variable, in one place."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

# The level names the error message lists (logging's aliases WARN, FATAL, NOTSET work too).
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_DIST_TIMEOUT_S = 600.0
MAX_DIST_TIMEOUT_S = 365 * 24 * 3600.0


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
    """GLMFLASH_LOG_LEVEL: a logging level name (default INFO); a ValueError names the variable
    for any other value."""
    raw = os.environ.get("GLMFLASH_LOG_LEVEL", "")
    value = raw.strip().upper() or "INFO"
    if not isinstance(logging.getLevelName(value), int):
        raise ValueError(f"GLMFLASH_LOG_LEVEL={raw!r}: expected one of "
                         f"{', '.join(name.lower() for name in LOG_LEVELS)}")
    return value


def configure_openmp() -> None:
    """Let torch's and numba's OpenMP runtimes stop spinning soon after a parallel region.

    Both load their own runtime; with the default spin policy their idle threads keep the
    cores the other needs busy (the CPU expert kernel fell from ~28 to ~4 GB/s). Must run before
    torch is imported; a value the user set is kept.
    """
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def dist_timeout_s() -> float:
    """GLMFLASH_DIST_TIMEOUT_S: how long a rank waits in a collective (or for the others to
    join) before it gives up; a rank that exits ends the others' wait at once on gloo.
    Seconds > 0 (default 600); a ValueError names the variable for any other value."""
    raw = os.environ.get("GLMFLASH_DIST_TIMEOUT_S", "")
    if not raw.strip():
        return DEFAULT_DIST_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    # A year at most: far larger ones overflow timedelta or the store's millisecond timeout.
    if not 0 < value <= MAX_DIST_TIMEOUT_S:
        raise ValueError(f"GLMFLASH_DIST_TIMEOUT_S={raw!r}: expected seconds > 0"
                         f"{' (at most a year)' if value > MAX_DIST_TIMEOUT_S else ''}")
    return value


def check() -> None:
    """Read each variable that has a checked value, so that a bad one is reported (one line, by
    the commands) before anything slow starts."""
    log_level()
    dist_timeout_s()


def test_fault() -> str | None:
    """GLMFLASH_TEST_FAULT="<rank>:<point>": that rank raises there (tests of rank failure)."""
    return os.environ.get("GLMFLASH_TEST_FAULT") or None
