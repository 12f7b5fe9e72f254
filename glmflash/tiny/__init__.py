"""Tiny embedded test checkpoint: files generated on the fly for tests and the default model."""

from __future__ import annotations
