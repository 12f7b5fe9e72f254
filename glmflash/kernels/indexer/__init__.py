"""DSA indexer ops: `indexer_write` (pool compression) and `indexer_select` (top-k pools + tail)."""

from __future__ import annotations

from glmflash.kernels.indexer.ref import compress_pools, indexer_select_ref, indexer_write_ref

indexer_write = indexer_write_ref
indexer_select = indexer_select_ref

__all__ = ["compress_pools", "indexer_select", "indexer_select_ref", "indexer_write",
           "indexer_write_ref"]
