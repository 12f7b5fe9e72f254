"""The KDA prefill's stages (chunk_stages.py, chunk_intra.py) at launch shapes other than the
defaults (test_kda_prefill.py has those) against kda/ref.py.

Without CUDA the kernels run under TRITON_INTERPRET=1 on one or two small heads; with CUDA the
`gpu` tests add the release shape (64 heads x 128, bf16) and fla's chunk_kda where installed.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glmflash.kernels.kda.chunk_stages import StagedConfig
from glmflash.kernels.kda.triton_impl import KdaConfig
from tests.kernels.kda_cases import (
    assert_bf16_close,
    kda_inputs,
    run_kda,
)
from tests.kernels.test_kda_prefill import PREFILL_CASES, _assert_fp32_close

# 16 channels a step, so that dim 16 runs one step and dim 24 two (the second masked).
SMALL = StagedConfig(diag_key_block=16, off_key_block=16, wy_block=16)
FORMS = {"small_steps": KdaConfig(staged=SMALL),
         "two_warps": KdaConfig(staged=dataclasses.replace(SMALL, diag_warps=2, off_warps=4)),
         "no_register_cap": KdaConfig(staged=dataclasses.replace(SMALL,
                                                                  diag_max_registers=None))}


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("lens", [PREFILL_CASES[c] for c in ("len17", "three_chunks_varlen",
                                                             "mixed_empty", "all_empty")],
                         ids=["len17", "three_chunks_varlen", "mixed_empty", "all_empty"])
def test_staged_fp32_matches_ref(lens, form, nan_empty):
    _assert_fp32_close(*run_kda(lens, heads=1, dim=16, dtype=torch.float32, config=form))


# The GPU release test's batch: ten sequences, an empty one between two long ones.
RELEASE_ODD = [1, 15, 16, 17, 63, 64, 65, 0, 129, 1000]


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_staged_odd_lengths(form, nan_empty):
    _assert_fp32_close(*run_kda([1, 15, 16, 63, 64, 65], heads=1, dim=16, dtype=torch.float32,
                                config=form))


def test_staged_release_odd_lengths(nan_empty):
    _assert_fp32_close(*run_kda(RELEASE_ODD, heads=1, dim=16, dtype=torch.float32,
                                config=FORMS["small_steps"]))


def test_shared_slot_is_refused():
    # The kernels run a batch's sequences concurrently; two sharing a slot would race on it
    # (the reference chains them, and the interpreter's in-order programs happen to as well).
    from glmflash.kernels.kda.triton_impl import kda

    q, k, v, g, beta, state = kda_inputs([3, 0, 1, 5], 1, 16, torch.float32)
    with pytest.raises(AssertionError, match="slot appears twice"):
        kda(q, k, v, g, beta, state, [0, 3, 3, 4, 9], [2, 2, 0, 2], [True, False, False, True])
    # an empty sequence may name a slot a real one holds
    kda(q, k, v, g, beta, state, [0, 3, 3, 4, 9], [2, 2, 0, 1], [True, False, False, True])


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_staged_several_channel_blocks(form, nan_empty):
    # 24 channels in blocks of 16: two steps over the channels, the second one masked
    _assert_fp32_close(*run_kda([70, 1, 33], heads=2, dim=24, dtype=torch.float32,
                                config=form))


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
@pytest.mark.parametrize("decay", [0.02, 2.0, 4.0],
                         ids=["weak", "some_channels_steep", "all_steep"])
def test_staged_decays(decay, form, nan_empty):
    # weak: far keys still interact, so every block of the inverse counts; steep: channels
    # whose decay across a sub-chunk exceeds SAFE_SPAN take the exact diagonal form
    _assert_fp32_close(*run_kda([40, 1, 70], heads=1, dim=16, dtype=torch.float32,
                                decay=decay, config=form))


def test_staged_bf16_inputs(nan_empty):
    assert_bf16_close(*run_kda([70, 1, 9], heads=1, dim=32, dtype=torch.bfloat16,
                                      config=FORMS["small_steps"]))


# Release launch shapes: bench/kda_sweep.py's candidates of the same names (its TEST_FORMS,
# which `python -m bench.kda_sweep --warm` compiles ahead of these tests).
GPU_FORMS = {"staged_solve_tf32": KdaConfig(staged=StagedConfig(solve_precision="tf32")),
             "staged_t_fp32": KdaConfig(staged=StagedConfig(inverse_bf16=False)),
             "staged_diag_regs_free": KdaConfig(staged=StagedConfig(diag_max_registers=None))}


@pytest.mark.gpu
@pytest.mark.parametrize("form", GPU_FORMS.values(), ids=GPU_FORMS.keys())
@pytest.mark.parametrize("lens", [[4096], RELEASE_ODD], ids=["prefill4k", "odd_lengths"])
def test_staged_release_shape_gpu(lens, form, nan_empty):
    assert_bf16_close(*run_kda(lens, heads=64, dim=128, dtype=torch.bfloat16,
                                      config=form))
