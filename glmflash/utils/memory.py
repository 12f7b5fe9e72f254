"""Handing freed memory back to the OS (glibc): without it a few large requests leave the
server's RSS hundreds of MB above its baseline for good.

glibc raises its mmap threshold to the size of the largest block freed so far (up to 32 MiB),
so after one large request every later one is served from the heaps, and each thread's arena
keeps what it freed. A fixed threshold keeps large blocks (request bodies, prompts, token lists)
in their own mappings, returned on free; `trim` returns what the heaps hold free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 1 << 20
TRIM_THRESHOLD_BYTES = 4 << 20


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    if libc is None or not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    return libc


def configure_allocator() -> None:
    """Fix glibc's mmap and trim thresholds (a no-op on other C libraries)."""
    libc = _libc()
    if libc is None:
        logger.debug("not glibc: allocator thresholds left as they are")
        return
    libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)


def trim() -> None:
    """Return the free pages of every malloc arena to the OS (glibc's malloc_trim)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
