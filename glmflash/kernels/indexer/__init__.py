"""DSA indexer ops: `indexer_write` (pool compression) and `indexer_select` (top-k pools + tail).

CUDA tensors go to the Triton selection (triton_impl.py), CPU tensors to ref.py;
`GLMFLASH_KERNEL_INDEXER_SELECT` (or `GLMFLASH_KERNEL_INDEXER` for both) `=ref|triton` forces
one. `indexer_write` has only the reference (a few rows per sequence and step).
"""

from __future__ import annotations

import torch

from glmflash.kernels.indexer.ref import compress_pools, indexer_select_ref, indexer_write_ref
from glmflash.utils.env import kernel_override

IMPLS = ("ref", "triton")

indexer_write = indexer_write_ref


def _use_triton(x: torch.Tensor) -> bool:
    choice = kernel_override("indexer_select") or kernel_override("indexer")
    if choice is None:
        return x.is_cuda
    if choice not in IMPLS:
        raise ValueError(f"unknown indexer_select impl {choice!r}; expected one of {IMPLS}")
    return choice == "triton"


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   context_slots: torch.Tensor, cu_context: list[int], cu_seqlens: list[int],
                   prefix_lens: list[int], *, topk: int, kpool: int,
                   select_tail: bool) -> torch.Tensor:
    """Token slots attended by each query `[T, topk + kpool - 1]`; see `indexer_select_ref`."""
    impl = indexer_select_ref
    if _use_triton(q):
        from glmflash.kernels.indexer.triton_impl import indexer_select as impl
    return impl(q, weights, pool_keys, context_slots, cu_context, cu_seqlens, prefix_lens,
                topk=topk, kpool=kpool, select_tail=select_tail)


__all__ = ["compress_pools", "indexer_select", "indexer_select_ref", "indexer_write",
           "indexer_write_ref"]
