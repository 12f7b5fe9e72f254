"""DSA indexer ops: `indexer_write` (pool compression) and `indexer_select` (top-k pools + tail).

CUDA tensors go to the Triton selection (triton_impl.py), CPU tensors to ref.py;
`GLMFLASH_KERNEL_INDEXER_SELECT` (or `GLMFLASH_KERNEL_INDEXER` for both) `=ref|triton` forces
one. `indexer_write` has only the reference (a few rows per sequence and step).
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.indexer.ref import compress_pools, indexer_select_ref, indexer_write_ref

indexer_write = indexer_write_ref


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   context_slots: torch.Tensor, cu_context: list[int], cu_seqlens: list[int],
                   prefix_lens: list[int], *, topk: int, kpool: int,
                   select_tail: bool) -> torch.Tensor:
    """Token slots attended by each query `[T, topk + kpool - 1]`; see `indexer_select_ref`."""
    impl = indexer_select_ref
    if use_triton(q, "indexer_select", "indexer"):
        from glmflash.kernels.indexer.triton_impl import indexer_select as impl
    return impl(q, weights, pool_keys, context_slots, cu_context, cu_seqlens, prefix_lens,
                topk=topk, kpool=kpool, select_tail=select_tail)


__all__ = ["compress_pools", "indexer_select", "indexer_select_ref", "indexer_write",
           "indexer_write_ref"]
