"""The verify kernels of KDA (kda/verify_triton.py): a whole verify's rows in one launch must
leave, bit for bit, what one decode launch per row leaves (outputs, the slots' states, the
scratch copies), including rows that switch to another slot mid-sequence (a CUDA graph's
padding rows) and sequences of one row; the reference dispatcher agrees within fp32 rounding.

Without CUDA the kernels run under TRITON_INTERPRET=1; with CUDA the same cases compile, and
a `gpu` case adds the release shape (64 heads x 128, bf16 inputs, one draft per sequence).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import glmflash.kernels.kda as dispatch
from glmflash.kernels.kda import triton_impl, verify_triton
from tests.kernels.kda_cases import DEVICE, kda_inputs

NUM_STEPS = 3
# Sequences as (first row, rows, scratch row); then each row's (state slot, fresh). The third
# sequence's last two rows are padding: the reserved slot 6, started afresh.
SEQS = [(0, 3, 0), (3, 1, 1), (4, 4, 2)]
ROW_SLOTS = [(2, 0), (2, 0), (2, 0), (0, 1), (4, 0), (4, 0), (6, 1), (6, 0)]
FP32_TOL = 1e-5  # as test_kda_triton.py: the reference sums in another order


def _metas(seqs=SEQS, row_slots=ROW_SLOTS):
    rows = torch.tensor([[r, s, f] for r, (s, f) in enumerate(row_slots)], dtype=torch.int32,
                        device=DEVICE)
    return rows, torch.tensor(seqs, dtype=torch.int32, device=DEVICE)


def _per_row(step, state: torch.Tensor, saved: torch.Tensor | None, rows: torch.Tensor,
             seqs: torch.Tensor) -> None:
    """What the verify did before: `step(state, row_meta)` one row at a time, then a copy of
    the slot into the scratch row after each row but a sequence's last."""
    for first, count, scratch_row in seqs.tolist():
        for j in range(count):
            step(state, rows[first + j: first + j + 1])
            if saved is not None and j < count - 1:
                saved[scratch_row * NUM_STEPS + j] = state[int(rows[first + j, 1])]


def _nan_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.full((rows, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)


def _kda_case(dtype=torch.float32, heads=2, dim=16):
    q, k, v, g, beta, state = kda_inputs([1] * len(ROW_SLOTS), heads, dim, dtype)
    return (q, k, v, g, beta), state[:7].contiguous()


@pytest.mark.parametrize("keep", [True, False], ids=["scratch", "no_scratch"])
def test_kda_verify_equals_decode_per_row_bit_for_bit(keep):
    inputs, state = _kda_case()
    rows, seqs = _metas()
    saved = _nan_like(state, len(SEQS) * NUM_STEPS) if keep else None
    want_state, want_saved = state.clone(), None if saved is None else saved.clone()
    want = torch.full((len(ROW_SLOTS), 2, 16), float("nan"), device=DEVICE)
    _per_row(lambda s, row: triton_impl.kda_decode(*inputs, s, row, want), want_state,
             want_saved, rows, seqs)
    got = verify_triton.kda_verify(*inputs, state, rows, seqs, saved, NUM_STEPS)
    assert torch.equal(got, want)
    assert torch.equal(state, want_state)
    if keep:
        assert torch.equal(saved.nan_to_num(7.0), want_saved.nan_to_num(7.0))
        # Rows of no position (the last of each sequence, and the one-row sequence) stay NaN.
        written = [0, 1, 6, 7, 8]
        assert not saved[written].isnan().any()
        assert saved[[2, 3, 4, 5]].isnan().all()


def test_kda_verify_reference_dispatch_agrees():
    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    inputs, state = _kda_case()
    rows, seqs = _metas()
    saved = _nan_like(state, len(SEQS) * NUM_STEPS)
    ref_state, ref_saved = state.clone(), saved.clone()
    got = verify_triton.kda_verify(*inputs, state, rows, seqs, saved, NUM_STEPS)
    want = dispatch.kda_verify(*inputs, ref_state, rows, seqs, ref_saved, NUM_STEPS)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(state, ref_state, atol=FP32_TOL * 10, rtol=FP32_TOL)
    assert torch.allclose(saved, ref_saved, atol=FP32_TOL * 10, rtol=FP32_TOL, equal_nan=True)


def _conv_case(dtype=torch.float32, channels=24):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(len(ROW_SLOTS), channels, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE)
    conv = torch.randn(7, channels, 3, generator=gen).to(dtype).to(DEVICE)
    return x, weight, conv


def _conv_step(x, weight, out):
    """One row's conv decode launch into `out`, as `_per_row` calls it."""
    def step(state, row):
        tok, slot, fresh = row[0].tolist()
        meta = torch.tensor([[tok, tok, tok + 1, slot, fresh]], dtype=torch.int32, device=DEVICE)
        triton_impl.causal_conv1d_decode(x, weight, state, meta, out)
    return step


@pytest.mark.parametrize("keep", [True, False], ids=["scratch", "no_scratch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_conv_verify_equals_decode_per_row_bit_for_bit(keep, dtype):
    x, weight, conv = _conv_case(dtype)
    rows, seqs = _metas()
    saved = _nan_like(conv, len(SEQS) * NUM_STEPS) if keep else None
    want_conv, want_saved = conv.clone(), None if saved is None else saved.clone()
    want = torch.full_like(x, float("nan"))
    _per_row(_conv_step(x, weight, want), want_conv, want_saved, rows, seqs)
    got = verify_triton.causal_conv1d_verify(x, weight, conv, rows, seqs, saved, NUM_STEPS)
    assert torch.equal(got, want)
    assert torch.equal(conv, want_conv)
    if keep:
        assert torch.equal(saved.float().nan_to_num(7.0), want_saved.float().nan_to_num(7.0))
        assert saved[[2, 3, 4, 5]].isnan().all()


def test_conv_verify_reference_dispatch_agrees():
    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    x, weight, conv = _conv_case()
    rows, seqs = _metas()
    saved = _nan_like(conv, len(SEQS) * NUM_STEPS)
    ref_conv, ref_saved = conv.clone(), saved.clone()
    got = verify_triton.causal_conv1d_verify(x, weight, conv, rows, seqs, saved, NUM_STEPS)
    want = dispatch.causal_conv1d_verify(x, weight, ref_conv, rows, seqs, ref_saved, NUM_STEPS)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.equal(conv, ref_conv)  # the window holds inputs: copies, no arithmetic
    assert torch.equal(saved.nan_to_num(7.0), ref_saved.nan_to_num(7.0))


def test_empty_verify_launches_nothing():
    inputs, state = _kda_case()
    rows = torch.zeros(0, 3, dtype=torch.int32, device=DEVICE)
    seqs = torch.zeros(0, 3, dtype=torch.int32, device=DEVICE)
    before = state.clone()
    verify_triton.kda_verify(*inputs, state, rows, seqs, None, NUM_STEPS)
    assert torch.equal(state, before)


def _release_rows(num: int) -> tuple[list, list]:
    """`num` sequences of two rows (one draft each, the MTP graphs' shape), then one whose
    second row is padding: the reserved slot `num + 1`, fresh."""
    seqs = [(2 * b, 2, b) for b in range(num + 1)]
    row_slots = [(b, 0) for b in range(num) for _ in range(2)] + [(num, 0), (num + 1, 1)]
    return seqs, row_slots


@pytest.mark.gpu
@pytest.mark.parametrize("num", [1, 16], ids=["narrow", "wide"])
def test_kda_verify_release_shape_gpu(num):
    """64 heads x 128, bf16 inputs: bit for bit a decode launch per row in the launch shape a
    decode of as many sequences takes (narrow, or wide from `decode_wide_batch`: another warp
    count sums the products over dk in another order)."""
    seqs, row_slots = _release_rows(num)
    wide = len(seqs) >= triton_impl.DEFAULT_CONFIG.decode_wide_batch
    same_shape = dataclasses.replace(triton_impl.DEFAULT_CONFIG,
                                     decode_wide_batch=1 if wide else len(row_slots) + 1)
    q, k, v, g, beta, state = kda_inputs([1] * len(row_slots), 64, 128, torch.bfloat16)
    rows, seq_meta = _metas(seqs, row_slots)
    saved = torch.zeros(len(seqs) * NUM_STEPS, 64, 128, 128, device=DEVICE)
    want_state, want_saved = state.clone(), saved.clone()
    want = torch.empty(len(row_slots), 64, 128, dtype=torch.bfloat16, device=DEVICE)
    _per_row(lambda s, row: triton_impl.kda_decode(q, k, v, g, beta, s, row, want,
                                                    config=same_shape), want_state,
             want_saved, rows, seq_meta)
    got = verify_triton.kda_verify(q, k, v, g, beta, state, rows, seq_meta, saved, NUM_STEPS)
    assert torch.equal(got, want) and torch.equal(state, want_state)
    assert torch.equal(saved, want_saved)


@pytest.mark.gpu
def test_conv_verify_release_shape_gpu():
    """3 x 8192 channels, bf16: bit for bit a decode launch per row."""
    seqs, row_slots = _release_rows(4)
    gen = torch.Generator().manual_seed(9)
    channels = 3 * 8192
    x = torch.randn(len(row_slots), channels, generator=gen).bfloat16().to(DEVICE)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE)
    conv = torch.randn(len(seqs) + 1, channels, 3, generator=gen).bfloat16().to(DEVICE)
    rows, seq_meta = _metas(seqs, row_slots)
    saved = torch.zeros(len(seqs) * NUM_STEPS, channels, 3, dtype=torch.bfloat16, device=DEVICE)
    want_conv, want_saved = conv.clone(), saved.clone()
    want = torch.empty_like(x)
    _per_row(_conv_step(x, weight, want), want_conv, want_saved, rows, seq_meta)
    got = verify_triton.causal_conv1d_verify(x, weight, conv, rows, seq_meta, saved, NUM_STEPS)
    assert torch.equal(got, want) and torch.equal(conv, want_conv)
    assert torch.equal(saved, want_saved)
