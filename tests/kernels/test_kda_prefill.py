"""Triton KDA chunked prefill at its default launch shapes (chunk_stages.py) against
kda/ref.py, and the intra stage's 16x16 inverse against torch (test_kda_chunk_stages.py tries
the other launch shapes and forms).

Without CUDA the kernels run under TRITON_INTERPRET=1 on one or two small heads (the
interpreter runs each program in Python); with CUDA they compile, and the `gpu` tests add the
release shape (64 heads x 128, bf16) and fla's chunk_kda where it is installed.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from glmflash.kernels.kda import chunk_intra
from tests.kernels.kda_cases import (
    DEVICE,
    against_fla,
    assert_bf16_close,
    rel_err,
    run_kda,
)

# fp32 inputs, interpreter: worst measured 7e-7 (outputs) / 5e-6 (state, |S| ~ 10), nearly all
# of it the reference's own rounding (the kernel is within 1e-7 of a float64 evaluation).
FP32_TOL = 1e-5

PREFILL_CASES = {
    "len15": [15],
    "len16": [16],
    "len17": [17],
    "len63": [63],
    "len64": [64],
    "len65": [65],
    "three_chunks_varlen": [130, 1, 64, 17],
    "mixed_empty": [0, 65, 1, 17, 0, 2, 16, 0],
    "all_empty": [0, 0],
}


def _assert_fp32_close(got, want, s_got, s_ref):
    assert got.shape == want.shape
    if got.numel():
        assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


@pytest.mark.parametrize("lens", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_fp32_matches_ref(lens, nan_empty):
    _assert_fp32_close(*run_kda(lens, heads=1, dim=16, dtype=torch.float32))


def test_prefill_weak_decay(nan_empty):
    # g in (-0.1, 0): keys far apart in a chunk still interact, so every block of the inverse
    # counts (at the release gate's decays the far blocks are below rounding)
    _assert_fp32_close(*run_kda([130, 17], heads=1, dim=16, dtype=torch.float32, decay=0.02))


@pytest.mark.parametrize("decay", [2.0, 4.0], ids=["some_channels_steep", "all_steep"])
def test_prefill_steep_decay(decay, nan_empty):
    # g down to -10 or -20 per token: channels whose decay across a sub-chunk exceeds
    # SAFE_SPAN take the exact form in its diagonal block (two or three of the 16 at 2.0, all
    # at 4.0), the others the factored one.
    _assert_fp32_close(*run_kda([40, 1, 70], heads=1, dim=16, dtype=torch.float32,
                                decay=decay))


def test_prefill_bf16_inputs(nan_empty):
    assert_bf16_close(*run_kda([70, 1, 9], heads=1, dim=32, dtype=torch.bfloat16))


@triton.jit
def _inverse_kernel(u, t):
    """The intra stage's (I + U)^-1 of a strictly upper-triangular 16x16 U."""
    o_r = tl.arange(0, 16)
    p = o_r[:, None] * 16 + o_r[None, :]
    tl.store(t + p, chunk_intra._unit_upper_inverse(tl.load(u + p), "ieee"))


def test_unit_upper_inverse_matches_torch():
    gen = torch.Generator().manual_seed(42)
    # a strictly upper-triangular U as the intra stage builds it: beta k_s . k_t, |U| < 1
    keys = torch.nn.functional.normalize(torch.randn(16, 8, generator=gen), dim=1)
    beta = torch.rand(16, generator=gen)
    upper = (keys @ keys.t() * beta[None, :]).triu(1)
    inv = torch.full((16, 16), float("nan"), device=DEVICE)
    _inverse_kernel[(1,)](upper.contiguous().to(DEVICE), inv)
    want = torch.linalg.inv(torch.eye(16, dtype=torch.float64) + upper.double())
    assert (inv.cpu().double() - want).abs().max().item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[4096], [1000, 1, 3000, 64, 1, 129],
                                  [1, 15, 16, 17, 63, 64, 65, 0, 129]],
                         ids=["prefill4k", "mixed", "odd_lengths"])
def test_prefill_release_shape_gpu(lens):
    assert_bf16_close(*run_kda(lens, heads=64, dim=128, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_prefill_release_shape_fp32_gpu():
    got, want, s_got, s_ref = run_kda([300, 1, 77], heads=64, dim=128, dtype=torch.float32)
    assert rel_err(got, want) < 1e-5
    assert rel_err(s_got, s_ref) < 1e-5


@pytest.mark.gpu
def test_prefill_steep_decay_gpu():
    # Steep channels make the diagonal kernel read back, after a barrier, the G its own threads
    # stored (the interpreter runs a program's threads as one, so only a GPU can show a race).
    assert_bf16_close(*run_kda([200, 1, 70], heads=64, dim=128, dtype=torch.bfloat16,
                                      decay=2.0))


@pytest.mark.gpu
def test_prefill_matches_fla_gpu():
    """Against fla's chunk_kda on its safe-gate path (our gate's lower bound is -5)."""
    # fla's output and ours each sit about 4e-3 from the fp32 reference (bf16 intermediates).
    assert_bf16_close(*against_fla())
