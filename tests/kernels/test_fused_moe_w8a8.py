"""The W8A8 prefill form of the grouped MoE (fused_moe/triton_w8a8.py) against a PyTorch
emulation of its numerics (tight) and against the fp32 ref.py (the activation quantisation's
own error), in the interpreter on CPU on odd shapes; with CUDA also at release shapes."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.fused_moe import fused_moe, fused_moe_ref, triton_impl
from glmflash.kernels.fused_moe.triton_impl import (
    PREFILL_CONFIG,
    W8A8MoeConfig,
    default_config,
)
from tests.kernels.test_fused_moe import (
    SHAPES,
    _release_case,
    make_routing,
    make_weights,
    norm_error,
)
from tests.kernels.w8a8_emulation import w8a8_moe_emulated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Against the emulation: fp32 x gives fp32 outputs, only the summation order differs (measured
# 3e-7); 16-bit x rounds each pair's output to it (bf16: ~4e-3 in norm).
EMULATION_FP32_REL = 1e-5
EMULATION_BF16_REL = 1e-2
# Against the fp32 reference: x and h rounded to e4m3 per 128 channels. Measured (norm): 4.3%
# on these shapes in the interpreter and 4.3% at release width (4096 x 2048, emulated on CPU).
W8A8_REL = 0.065
# With binding clamps (limit 0.3) many pre-activations sit on the clamp and the output is small
# against the quantisation steps of x: 8.8% measured.
W8A8_CLAMPED_REL = 0.12
SMALL = W8A8MoeConfig(block_m=16)


def check(x, ids, weights, experts, *, limit=10.0, block=128, config=SMALL, ref_rel=W8A8_REL):
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=limit, block=block,
                                config=config)
    assert got.shape == x.shape and got.dtype == x.dtype and not got.isnan().any()
    emulated = w8a8_moe_emulated(x, ids, weights, *experts, limit=limit, block=block)
    tol = EMULATION_FP32_REL if x.dtype == torch.float32 else EMULATION_BF16_REL
    assert norm_error(got, emulated) <= tol
    want = fused_moe_ref(x, ids, weights, *experts, limit=limit, block=block)
    assert norm_error(got, want) <= ref_rel
    return got


def _case(shape, num_tokens, top_k, gen, dtype=torch.float32):
    experts = make_weights(*shape, gen)
    x = torch.randn(num_tokens, shape[1], generator=gen).to(DEVICE, dtype)
    ids, weights = make_routing(num_tokens, top_k, shape[0], gen)
    return x, ids, weights, experts


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_matches_emulation_and_ref(shape, num_tokens, seeded, nan_empty):
    check(*_case(shape, num_tokens, 2, seeded))


def test_every_expert_hit_and_experts_without_tokens(seeded, nan_empty):
    x, ids, weights, experts = _case(SHAPES["tiny-8x192x96"], 6, 4, seeded)
    assert ids.unique().numel() == 8
    check(x, ids, weights, experts)
    # experts 5 and 7 get no token
    ids = torch.stack([torch.full((6,), 6), torch.arange(6) % 5], 1).to(DEVICE)
    check(x, ids, weights[:, :2], experts)


VARIANTS = {"bm16": SMALL, "bm64-bk64-group2": W8A8MoeConfig(block_m=64, block_k=64, group_m=2)}


@pytest.mark.parametrize("config", VARIANTS.values(), ids=VARIANTS.keys())
def test_one_expert_over_several_blocks_and_skipped_pairs(config, seeded, nan_empty):
    x, _, weights, experts = _case(SHAPES["edge-5x200x72"], 37, 2, seeded)
    # 37 rows on expert 2 (three partial 16-row blocks, or one 64-row block), some pairs -1
    ids = torch.stack([torch.full((37,), 2), torch.arange(37) % 3 * 2 - 1], 1).to(DEVICE)
    check(x, ids, weights, experts, config=config)


def test_two_column_blocks_of_h_and_bf16(seeded, nan_empty):
    # I = 130: h has a full and a 2-column scale block; D = 256: the down projection's second
    # 128-column tile is real
    x, ids, weights, experts = _case(SHAPES["blocks-4x256x130"], 9, 3, seeded)
    check(x, ids, weights, experts)
    check(x.bfloat16(), ids, weights, experts)


def test_block64_weights(seeded, nan_empty):
    gen = seeded
    experts = make_weights(8, 192, 96, gen, block=64)
    x = torch.randn(4, 192, generator=gen).to(DEVICE)
    ids, weights = make_routing(4, 2, 8, gen)
    check(x, ids, weights, experts, block=64, config=W8A8MoeConfig(block_m=16, block_k=64))


def test_clamps_bind(seeded, nan_empty):
    x, ids, weights, experts = _case(SHAPES["edge-5x200x72"], 7, 3, seeded)
    got = check(x, ids, weights, experts, limit=0.3, ref_rel=W8A8_CLAMPED_REL)
    unclamped = fused_moe_ref(x, ids, weights, *experts, limit=1e9)
    # the clamps change the result by far more than the quantisation does
    assert norm_error(got, unclamped) > 3 * W8A8_CLAMPED_REL


def test_default_config_keeps_fp32_and_decode_off_w8a8(seeded):
    x = torch.zeros(2, 8, device=DEVICE)
    assert not isinstance(default_config(4096, 8, x, True, 128), W8A8MoeConfig)
    assert not isinstance(default_config(4, 8, x.bfloat16(), True, 128), W8A8MoeConfig)
    assert default_config(4096, 8, x.bfloat16(), False, 128) == PREFILL_CONFIG


def _has_fp8_products() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [2048, 8192])
def test_release_shapes_gpu(num_tokens):
    if not _has_fp8_products():
        pytest.skip("no FP8 products before SM89")
    x, ids, weights, experts = _release_case(num_tokens)
    auto = fused_moe(x, ids, weights, *experts, limit=10.0)
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0,
                                config=triton_impl.DEFAULT_DISPATCH.w8a8)
    # The Gluon form (SM90) computes each row as the Triton one does: the same bits.
    assert torch.equal(auto, got), "prefill with FP8 weights takes the W8A8 numerics"
    check_release(got, x, ids, weights, experts)


def check_release(got, x, ids, weights, experts, *, limit=10.0, ref_rel=W8A8_REL):
    """A release-width W8A8 output: no NaN, the emulation's numerics, the reference's within
    the activation quantisation."""
    assert not got.isnan().any()
    emulated = w8a8_moe_emulated(x, ids, weights, *experts, limit=limit)
    assert norm_error(got, emulated) <= EMULATION_BF16_REL
    want = fused_moe_ref(x, ids, weights, *experts, limit=limit)
    assert norm_error(got, want) <= ref_rel


@pytest.mark.gpu
@pytest.mark.parametrize("config", [W8A8MoeConfig(), W8A8MoeConfig(block_m=128, group_m=4),
                                    W8A8MoeConfig(block_k=64, gate_up_stages=6,
                                                  down_stages=6)],
                         ids=["default", "bm128", "bk64-6stages"])
def test_launch_shapes_gpu(config):
    if not _has_fp8_products():
        pytest.skip("no FP8 products before SM89")
    x, ids, weights, experts = _release_case(512, num_experts=16)
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=config)
    emulated = w8a8_moe_emulated(x, ids, weights, *experts, limit=10.0)
    assert norm_error(got, emulated) <= EMULATION_BF16_REL


@pytest.mark.gpu
def test_no_host_sync_gpu():
    if not _has_fp8_products():
        pytest.skip("no FP8 products before SM89")
    x, ids, weights, experts = _release_case(256, num_experts=16)
    config = triton_impl.DEFAULT_DISPATCH.w8a8
    triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=config)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=config)
    finally:
        torch.cuda.set_sync_debug_mode(0)

