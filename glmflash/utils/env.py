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


def log_level() -> str:
    return os.environ.get("GLMFLASH_LOG_LEVEL", "INFO").upper()
