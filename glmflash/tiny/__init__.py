"""Tiny checkpoints: the trained default model shipped in the package, and random test
checkpoints made on the fly (the real architecture and release layout at toy sizes)."""

from __future__ import annotations
