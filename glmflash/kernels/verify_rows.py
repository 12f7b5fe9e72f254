"""The layout the speculative verify's state kernels share (KDA state and conv window,
kda/verify_triton.py; indexer tail, indexer/write_triton.py; their references): `seqs` `[B, 3]`
int32 holds each sequence's first row, its number of rows and its scratch row (-1: nothing
kept). After each row j but a sequence's last, the state is kept in scratch row
`scratch_row * num_steps + j`."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from glmflash.kernels.triton_utils import jit

try:
    import triton.language as tl
except ImportError:  # the package must import without triton; the kernels need it
    tl = None


@jit
def sequence_rows(seqs, i_b):
    """Sequence i_b's (first row, number of rows, scratch row as int64)."""
    first = tl.load(seqs + i_b * 3)
    num_rows = tl.load(seqs + i_b * 3 + 1)
    return first, num_rows, tl.load(seqs + i_b * 3 + 2).to(tl.int64)


@jit
def keeps_copy(scratch_row, j, num_rows):
    """1 (int32) where the state after row j is kept: a scratch row and a row after j."""
    return ((scratch_row >= 0) & (j < num_rows - 1)).to(tl.int32)


def reference_rows(seqs: torch.Tensor, num_steps: int) -> Iterator[tuple[int, int | None]]:
    """Each sequence's rows in order (read back to the host): (row, the scratch row that keeps
    the state after it, or None)."""
    for first, count, scratch_row in seqs.tolist():
        for j in range(count):
            kept = scratch_row >= 0 and j < count - 1
            yield first + j, scratch_row * num_steps + j if kept else None
