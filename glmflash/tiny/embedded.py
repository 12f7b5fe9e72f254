"""The embedded default model: the tiny checkpoint, made once into the cache folder."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

from glmflash.tiny.checkpoint import make_tiny_checkpoint
from glmflash.utils.env import cache_dir

logger = logging.getLogger(__name__)

# Bump when the tiny checkpoint's contents change, so stale caches are not reused.
TINY_FORMAT_VERSION = 1
DEFAULT_SEED = 0


def embedded_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """Path of the tiny checkpoint for `seed`, making it on first use (atomic rename)."""
    target = cache_dir() / f"tiny-v{TINY_FORMAT_VERSION}-seed{seed}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("making the embedded tiny checkpoint in %s (once)", target)
    staging = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        make_tiny_checkpoint(staging, seed=seed)
        os.replace(staging, target)
    except OSError:
        # Another process finished first: keep theirs.
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
