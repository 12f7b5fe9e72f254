"""DSA indexer ops: `indexer_write` (pool compression) and `indexer_select` (top-k pools + tail).

Both reach a sequence's earlier tokens through the page table. The per-forward plans
(`write_plan`, `select_plan`) are host index arithmetic over the new tokens, uploaded once and
shared by every indexer layer. CUDA tensors go to the Triton selection (triton_impl.py), CPU
tensors to ref.py; `GLMFLASH_KERNEL_INDEXER_SELECT` (or `GLMFLASH_KERNEL_INDEXER` for both)
`=ref|triton` forces one (`GLMFLASH_KERNEL_INDEXER_WRITE` for the decode write).
`indexer_write` is the reference on every device (a few gathers and scatters per forward, no
host sync). Batches of decodes take `decode_select_plan` and `indexer_write_decode` (one Triton
launch on CUDA), whose rows and positions stay on the device (CUDA graphs).
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
    indexer_write_ref,
    select_plan,
    write_plan,
)
from glmflash.kernels.indexer.ref import (
    indexer_write_decode as decode_write_ref,
)
from glmflash.kernels.verify_rows import reference_rows

indexer_write = indexer_write_ref


def indexer_write_decode(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, *, page_size: int) -> None:
    """One new token per sequence into the pooled keys or the tail; see
    `ref.indexer_write_decode` (write_triton.py: the same in one launch)."""
    impl = decode_write_ref
    if use_triton(keys, "indexer_write", "indexer"):
        from glmflash.kernels.indexer.write_triton import indexer_write_decode as impl
    impl(keys, gates, ape, pool_keys, tail, page_table, rows, positions, page_size=page_size)


def indexer_write_verify(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         slots: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                         saved: torch.Tensor | None, num_steps: int, *, page_size: int) -> None:
    """`indexer_write_decode` over a speculative verify's rows (row r: keys / gates row r, slot
    `slots[r]`, position `positions[r]`), each sequence's rows in order (`seqs` `[B, 3]` int32:
    first row, rows, scratch row or -1); after each row but a sequence's last its tail is also
    written to `saved[scratch_row * num_steps + j]` (None: nothing kept). The Triton path is
    one launch (write_triton.py); the reference writes one row at a time."""
    if use_triton(keys, "indexer_write", "indexer"):
        from glmflash.kernels.indexer.write_triton import indexer_write_verify as impl

        impl(keys, gates, ape, pool_keys, tail, page_table, slots, positions, seqs, saved,
             num_steps, page_size=page_size)
        return
    for r, kept in reference_rows(seqs, num_steps):
        row = slice(r, r + 1)
        decode_write_ref(keys[row], gates[row], ape, pool_keys, tail, page_table, slots[row],
                         positions[row], page_size=page_size)
        if saved is not None and kept is not None:
            saved[kept] = tail[int(slots[r])]


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   page_table: torch.Tensor, plan: SelectPlan, *, page_size: int, topk: int,
                   kpool: int, select_tail: bool, tiling: SelectTiling | None = None,
                   weight_scale: float = 1.0, fp8_queries: bool = False) -> torch.Tensor:
    """Token slots attended by each query `[T, topk + kpool - 1]`; see `indexer_select_ref`.
    `tiling` bounds the scoring workspace (each implementation has its default);
    `weight_scale` multiplies the head weights after their cast to fp32 (in the kernel);
    `fp8_queries` (FP8 pooled keys only) scores e4m3 query rows."""
    impl = indexer_select_ref
    if use_triton(q, "indexer_select", "indexer"):
        from glmflash.kernels.indexer.triton_impl import indexer_select as impl
    return impl(q, weights, pool_keys, page_table, plan, page_size=page_size, topk=topk,
                kpool=kpool, select_tail=select_tail, tiling=tiling, weight_scale=weight_scale,
                fp8_queries=fp8_queries)


__all__ = ["SelectPlan", "SelectTiling", "WritePlan", "compress_pools", "decode_select_plan",
           "indexer_select", "indexer_select_ref", "indexer_write", "indexer_write_decode",
           "indexer_write_ref", "indexer_write_verify", "select_plan", "write_plan"]
