"""DSA indexer ops: `indexer_write` (pool compression) and `indexer_select` (top-k pools + tail).

Both reach a sequence's earlier tokens through the page table. The per-forward plans
(`write_plan`, `select_plan`) are host index arithmetic over the new tokens, uploaded once and
shared by every indexer layer. CUDA tensors go to the Triton selection (triton_impl.py), CPU
tensors to ref.py; `GLMFLASH_KERNEL_INDEXER_SELECT` (or `GLMFLASH_KERNEL_INDEXER` for both)
`=ref|triton` forces one. `indexer_write` is the reference on every device (a few gathers and
scatters, no host sync). Batches of decodes take `decode_select_plan` and `indexer_write_decode`,
whose rows and positions stay on the device (CUDA graphs).
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.indexer.ref import (
    SelectPlan,
    SelectTiling,
    WritePlan,
    compress_pools,
    decode_select_plan,
    indexer_select_ref,
    indexer_write_decode,
    indexer_write_ref,
    select_plan,
    write_plan,
)

indexer_write = indexer_write_ref


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   page_table: torch.Tensor, plan: SelectPlan, *, page_size: int, topk: int,
                   kpool: int, select_tail: bool,
                   tiling: SelectTiling | None = None) -> torch.Tensor:
    """Token slots attended by each query `[T, topk + kpool - 1]`; see `indexer_select_ref`.
    `tiling` bounds the scoring workspace (each implementation has its default)."""
    impl = indexer_select_ref
    if use_triton(q, "indexer_select", "indexer"):
        from glmflash.kernels.indexer.triton_impl import indexer_select as impl
    return impl(q, weights, pool_keys, page_table, plan, page_size=page_size, topk=topk,
                kpool=kpool, select_tail=select_tail, tiling=tiling)


__all__ = ["SelectPlan", "SelectTiling", "WritePlan", "compress_pools", "decode_select_plan",
           "indexer_select", "indexer_select_ref", "indexer_write", "indexer_write_decode",
           "indexer_write_ref", "select_plan", "write_plan"]
