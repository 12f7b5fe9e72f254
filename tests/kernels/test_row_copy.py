"""Triton `copy_rows` against the reference: skipped rows untouched, the others copied exactly.
Interpreter on the CPU, compiled with CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.row_copy import copy_rows_ref
from glmflash.kernels.row_copy.triton_impl import copy_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check(row_shape, src_rows, dst_rows, *, num_dst=8, dtype=torch.float32):
    gen = torch.Generator().manual_seed(len(src_rows))
    src = torch.randn(6, *row_shape, generator=gen).to(dtype).to(DEVICE)
    dst = torch.randn(num_dst, *row_shape, generator=gen).to(dtype).to(DEVICE)
    # The indices as columns of one tensor (strided views, as a captured commit passes them).
    both = torch.tensor([src_rows, dst_rows], dtype=torch.int64, device=DEVICE).reshape(2, -1)
    index = list(both.t().contiguous().unbind(1))
    want, got = dst.clone(), dst.clone()
    copy_rows_ref(src, index[0], want, index[1])
    copy_rows(src, index[0], got, index[1])
    assert torch.equal(got, want)
    return (got != dst).flatten(1).any(1).sum().item()


@pytest.mark.parametrize("row_shape", [(3, 7), (1,), (4100,)])
def test_copies_and_skips(row_shape):
    # Row 2 is skipped (negative source); rows 0, 5 and 1 land in dst rows 7, 0 and 3.
    assert _check(row_shape, [0, -1, 5, 1], [7, 2, 0, 3]) == 3


def test_bf16_rows_into_a_larger_tensor():
    # The commit's shape: a few rows of a [layers * slots, ...] block.
    assert _check((2, 5), [4, 0, 3], [2, 5, 11], num_dst=12, dtype=torch.bfloat16) == 3


def test_nothing_to_copy():
    assert _check((3,), [], []) == 0
    assert _check((3,), [-1, -1], [0, 1]) == 0


@pytest.mark.parametrize("shape", [(0, 3), (4, 0)], ids=["no_rows", "rows_of_nothing"])
def test_empty_tensors(shape):
    none = torch.empty(0, dtype=torch.int64, device=DEVICE)
    src, dst = torch.zeros(*shape, device=DEVICE), torch.zeros(*shape, device=DEVICE)
    copy_rows(src, none, dst, none)
    copy_rows_ref(src, none, dst, none)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_release_kda_state_rows():
    # 4 MiB fp32 rows (64 heads x 128 x 128), the commit's skipped row and strided indices.
    assert _check((64, 128, 128), [2, -1, 0], [1, 4, 3], num_dst=5) == 2
