"""Triton `copy_rows`: one launch, a program per (row, block of the row's elements); a row
whose source index is negative is skipped without reading or writing anything."""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit

# Elements per program by default: 16 KiB of fp32 rows, 256 programs for a 4 MiB KDA state row.
DEFAULT_BLOCK = 4096


# The width stays specialised (fixed per kind of state): its 16-alignment lets the loads and
# stores vectorise.
@jit
def copy_rows_kernel(src, src_rows, dst, dst_rows, width, stride_src_rows, stride_dst_rows,
                     BLOCK: tl.constexpr):
    """Elements [j * BLOCK, +BLOCK) of row i: dst row `dst_rows[i]` from src row
    `src_rows[i]`, unless that is negative."""
    i, j = tl.program_id(0), tl.program_id(1)
    source = tl.load(src_rows + i * stride_src_rows).to(tl.int64)
    if source >= 0:
        target = tl.load(dst_rows + i * stride_dst_rows).to(tl.int64)
        o = j * BLOCK + tl.arange(0, BLOCK)
        m = o < width
        values = tl.load(src + source * width + o, mask=m)
        tl.store(dst + target * width + o, values, mask=m)


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
              dst_rows: torch.Tensor, *, block: int = DEFAULT_BLOCK) -> None:
    """See `row_copy.copy_rows`; `block`: elements per program (a power of two)."""
    rows, width = src_rows.numel(), math.prod(src.shape[1:])
    if rows == 0 or width == 0:
        return
    assert src[0:1].is_contiguous() and dst[0:1].is_contiguous(), "rows must be contiguous"
    assert src.stride(0) == dst.stride(0) == width, "rows back to back"
    block = min(block, triton.next_power_of_2(width))
    copy_rows_kernel[(rows, triton.cdiv(width, block))](
        src, src_rows, dst, dst_rows, width, src_rows.stride(0), dst_rows.stride(0),
        BLOCK=block, num_warps=4 if block >= 1024 else 1)
