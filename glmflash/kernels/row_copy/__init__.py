"""Copy whole rows between state tensors by device indices: `copy_rows` (the speculative
verify commits the accepted position's scratch copy of each state).

CUDA tensors go to one Triton launch (triton_impl.py); CPU tensors to ref.py (a gather, a
select and a scatter); `GLMFLASH_KERNEL_ROW_COPY=ref|triton` forces one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.row_copy.ref import copy_rows_ref


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor) -> None:
    """`dst[dst_rows[i]] = src[src_rows[i]]` for every i whose `src_rows[i] >= 0` (the others
    leave their row as it is). src and dst: `[N, ...]` of one dtype and row shape, rows
    contiguous; the row indices int64 on their device; target rows distinct. Nothing is read on
    the host (CUDA graphs)."""
    assert src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:], (
        f"rows of one kind: {src.dtype}{tuple(src.shape)} vs {dst.dtype}{tuple(dst.shape)}")
    assert src_rows.shape == dst_rows.shape and src_rows.dim() == 1
    if use_triton(src, "row_copy"):
        from glmflash.kernels.row_copy.triton_impl import copy_rows as impl
    else:
        impl = copy_rows_ref
    impl(src, src_rows, dst, dst_rows)


__all__ = ["copy_rows", "copy_rows_ref"]
