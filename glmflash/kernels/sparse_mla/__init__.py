"""Sparse MLA over the indexer's selection: `sparse_mla(q_lat, latent, slots, scale=...)`."""

from __future__ import annotations

from glmflash.kernels.sparse_mla.ref import sparse_mla_ref

sparse_mla = sparse_mla_ref

__all__ = ["sparse_mla", "sparse_mla_ref"]
