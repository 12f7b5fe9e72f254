"""The default model: the trained tiny checkpoint shipped in the package; and the random tiny
test checkpoint, made once into the cache folder (`glmflash make-tiny`)."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from glmflash.tiny.checkpoint import make_tiny_checkpoint
from glmflash.utils.env import cache_dir

logger = logging.getLogger(__name__)

# Bump when the random tiny checkpoint's contents change, so stale caches are not reused.
TINY_FORMAT_VERSION = 1
DEFAULT_SEED = 0
TRAINED_ASSET = "tiny_trained"


def embedded_checkpoint() -> Path:
    """Path of the trained tiny checkpoint in the package (tools/train_tiny.py made it)."""
    path = Path(str(resources.files("glmflash").joinpath("assets", TRAINED_ASSET)))
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"the trained tiny checkpoint is missing from {path}")
    return path


def random_tiny_checkpoint(seed: int = DEFAULT_SEED) -> Path:
    """Path of the random tiny checkpoint for `seed`, made on first use (atomic rename)."""
    target = cache_dir() / f"tiny-v{TINY_FORMAT_VERSION}-seed{seed}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("making the random tiny checkpoint in %s (once)", target)
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
