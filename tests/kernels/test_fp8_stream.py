"""The weight-streaming W8A8 linear for 2..63 rows (fp8_gemm/triton_stream.py) against a
PyTorch emulation of its numerics and the fp32 reference; interpreter on CPU on odd shapes and
splits, release shapes with CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glmflash.kernels.fp8_gemm import fp8_linear_ref, triton_common, triton_impl
from glmflash.kernels.fp8_gemm.triton_stream import (
    H200_ONE_ROW_RULE,
    H200_STREAM_RULE,
    STREAM_CONFIG,
    StreamConfig,
    StreamRule,
    fp8_linear_stream,
)
from tests.kernels.test_fp8_gemm_triton import _case
from tests.kernels.w8a8_emulation import w8a8_linear_emulated

# fp32 x: the emulation's products, in another order (measured 2.5e-7 in norm).
EMULATION_FP32_REL = 1e-5
# bf16 x: one bf16 rounding of the output (~4e-3 in norm; the interpreter truncates).
EMULATION_BF16_REL = 1e-2
# e4m3 activations against the fp32 reference: measured 2.4-2.6% in norm (release shapes
# emulated on CPU, and these shapes).
W8A8_REL = 0.035


def norm_error(got, want) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def check(x, w, s, block=128, config=STREAM_CONFIG):
    got = fp8_linear_stream(x, w, s, block, config)
    assert got.shape == (x.shape[0], w.shape[0]) and got.dtype == x.dtype
    assert not got.isnan().any()
    tol = EMULATION_FP32_REL if x.dtype == torch.float32 else EMULATION_BF16_REL
    assert norm_error(got, w8a8_linear_emulated(x, w, s, block)) <= tol
    assert norm_error(got, fp8_linear_ref(x.float(), w, s, block=block)) <= W8A8_REL
    return got


# rows x columns x K: 2 and 63 rows, partial row, column and K blocks, K over several ranges
SHAPES = {"2x70x200": (2, 70, 200), "16x192x512": (16, 192, 512), "17x130x257": (17, 130, 257),
          "40x64x128": (40, 64, 128), "63x129x1100": (63, 129, 1100)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_matches_emulation_and_ref(shape, nan_empty):
    check(*_case(*shape, torch.float32))


def test_bf16_block64_and_one_range(nan_empty):
    x, w, s = _case(5, 256, 384, torch.bfloat16, block=64)
    check(x, w, s, block=64)
    check(x, w, s, block=64, config=StreamConfig(waves=0.01))


def test_split_is_deterministic_and_leaves_counters_at_zero(nan_empty):
    x, w, s = _case(16, 200, 1100, torch.float32)
    first = check(x, w, s, config=StreamConfig(waves=64, min_split_blocks=1))
    assert int(triton_common.ARRIVALS[x.device].count_nonzero()) == 0
    one_range = fp8_linear_stream(x, w, s, 128, StreamConfig(waves=0.01))
    assert norm_error(first, one_range) <= EMULATION_FP32_REL
    assert torch.equal(fp8_linear_stream(x, w, s, 128, StreamConfig(waves=64,
                                                                     min_split_blocks=1)), first)
    # Nine ranges: the finish adding four partials per round trip (instead of the default's
    # eight at 16 rows) keeps the range order, hence the bits.
    four = StreamConfig(waves=64, min_split_blocks=1, finish_registers=32)
    assert four.finish_group(64, 16) == 4 and StreamConfig().finish_group(64, 16) == 8
    assert torch.equal(fp8_linear_stream(x, w, s, 128, four), first)
    assert int(triton_common.ARRIVALS[x.device].count_nonzero()) == 0


def test_rows_are_independent(nan_empty):
    """Each row is quantised on its own: a row's output does not depend on the other rows."""
    x, w, s = _case(16, 130, 384, torch.float32)
    alone = fp8_linear_stream(x[3:4].repeat(2, 1), w, s, 128)[0]
    x[5] *= 1e3
    assert torch.equal(fp8_linear_stream(x, w, s, 128)[3], alone)


def test_rule_picks_the_first_fitting_entry():
    short_k, wide = StreamConfig(waves=2.0), StreamConfig(num_stages=6)
    rule = StreamRule(((0, 2048, 1 << 30, short_k), (0, 1 << 30, 4096, wide)))
    assert rule.pick(16384, 1536) == short_k  # K fits the first entry
    assert rule.pick(4096, 16384) == wide
    assert rule.pick(24576, 4096) == STREAM_CONFIG  # fits none: the default
    assert StreamRule().pick(1536, 4096) == STREAM_CONFIG


# The sweep's fastest launch shape at 16 rows per release shape (K, N) on the H200:
# (block_n, waves, min split blocks, warps, stages).
H200_FASTEST = {(4096, 1536): (64, 4.0, 4, 4, 4), (1536, 16384): (64, 1.0, 2, 4, 6),
                (16384, 4096): (64, 2.0, 2, 4, 6), (4096, 4096): (128, 2.0, 2, 8, 4),
                (4096, 24576): (64, 1.0, 2, 4, 6)}


@pytest.mark.parametrize("k,n", H200_FASTEST.keys(), ids=[f"{k}->{n}" for k, n in H200_FASTEST])
def test_h200_rule_picks_the_fastest_shape(k, n):
    assert H200_STREAM_RULE.pick(n, k) == StreamConfig(*H200_FASTEST[k, n])


# The one-row FMA sweep's fastest (columns, waves) per release shape on the H200 (within 0.1 us
# of it where two tie; bench/sweeps.py --ops fp8row at 51addd6).
H200_ONE_ROW_FASTEST = {(4096, 1536): (32, 8.0), (1536, 16384): (32, 4.0),
                        (16384, 4096): (64, 8.0), (4096, 4096): (32, 8.0),
                        (4096, 24576): (32, 4.0)}


@pytest.mark.parametrize("k,n", H200_ONE_ROW_FASTEST.keys(),
                         ids=[f"{k}->{n}" for k, n in H200_ONE_ROW_FASTEST])
def test_h200_one_row_rule_picks_the_fastest_shape(k, n):
    shape = H200_ONE_ROW_RULE.pick(n, k)
    assert (shape.block_n, shape.waves) == H200_ONE_ROW_FASTEST[k, n]


def test_one_row_shape_by_rule_on_its_gpu(monkeypatch):
    cuda = torch.device("cuda")
    config = triton_impl.DEFAULT_CONFIG
    for capability, rule in (((9, 0), True), ((8, 9), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        got = triton_impl._weight_only_shape(config, True, (4096, 16384), cuda)
        assert (got.block_n, got.waves) == ((64, 8.0) if rule else (32, 4.0))
    # products past the codes rows and CPU tensors keep the wdq_* fields
    assert triton_impl._weight_only_shape(config, False, (4096, 16384), cuda).block_n == 64
    assert triton_impl._weight_only_shape(config, True, (4096, 16384),
                                          torch.device("cpu")).waves == 4.0


# The fp16-codes sweep's fastest (columns, waves) per release shape on the H200, summed over 2,
# 8, 16 and 32 rows (bench/sweeps.py --ops fp8codes, session 24); 1536->16384 unsplit, from the
# 16-row grid (--ops fp8codes_grid, session 25).
H200_CODES_FASTEST = {(4096, 1536): (64, 2.0), (1536, 16384): (64, 1.0),
                      (16384, 4096): (64, 4.0), (4096, 4096): (64, 4.0),
                      (4096, 24576): (64, 2.0)}


@pytest.mark.parametrize("k,n", H200_CODES_FASTEST.keys(),
                         ids=[f"{k}->{n}" for k, n in H200_CODES_FASTEST])
def test_h200_codes_rule_picks_the_fastest_shape(k, n, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d: (9, 0))
    config = triton_impl.DEFAULT_CONFIG
    shape = triton_impl._weight_only_shape(config, False, (n, k), torch.device("cuda"), True)
    assert (shape.block_n, shape.waves) == H200_CODES_FASTEST[k, n]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d: (12, 0))
    other = triton_impl._weight_only_shape(config, False, (n, k), torch.device("cuda"), True)
    assert (other.block_n, other.waves) == (config.wdq_block_n, config.wdq_waves)


@pytest.mark.gpu
def test_one_row_follows_its_rule():
    x, w, s = _case(1, 4096, 16384, torch.bfloat16)
    shape = StreamConfig(block_n=64, waves=8.0)
    rule = triton_impl.Fp8LinearConfig(one_row_rule=StreamRule(((0, 1 << 30, 1 << 30, shape),)))
    fields = dataclasses.replace(rule, one_row_rule=None, wdq_fma_block_n=64, wdq_waves=8.0)
    assert torch.equal(triton_impl.fp8_linear(x, w, s, config=rule),
                       triton_impl.fp8_linear(x, w, s, config=fields))


def test_rule_keeps_to_its_gpu(monkeypatch):
    """Other GPUs take the fallback (the rule's shapes need the H200's shared memory)."""
    cpu = torch.device("cpu")
    for capability, fastest in (((9, 0), True), ((8, 9), False), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d, c=capability: c)
        got = H200_STREAM_RULE.pick_for(4096, 4096, cpu)
        assert got == (StreamConfig(*H200_FASTEST[4096, 4096]) if fastest else STREAM_CONFIG)
    assert StreamRule().pick_for(4096, 4096, cpu) == STREAM_CONFIG  # no GPU named: everywhere


@pytest.mark.gpu
def test_linear_follows_the_rule():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products before SM89")
    x, w, s = _case(16, 1536, 4096, torch.bfloat16)
    shape = StreamConfig(waves=1.0, num_stages=6)
    # 16 rows, where the rules were measured: without the fp16-codes form there.
    config = triton_impl.Fp8LinearConfig(stream_rule=StreamRule(((0, 1 << 30, 1 << 30, shape),)),
                                         codes_max_rows=0)
    assert torch.equal(triton_impl.fp8_linear(x, w, s, config=config),
                       fp8_linear_stream(x, w, s, 128, shape))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [2, 16, 33, 63])
@pytest.mark.parametrize("n,k", [(1536, 4096), (16384, 1536), (4096, 16384), (4096, 4096),
                                 (24576, 4096)])
def test_release_shapes_gpu(m, n, k):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products before SM89")
    x, w, s = _case(m, n, k, torch.bfloat16)
    config = triton_impl.DEFAULT_CONFIG
    got = check(x, w, s, config=config.stream_rule.pick_for(n, k, x.device, config.stream))
    if m <= config.codes_max_rows:  # the weight-only kernel on fp16 codes takes these rows
        got = triton_impl.fp8_linear_weight_only(x, w, s, 128, config)
    assert torch.equal(triton_impl.fp8_linear(x, w, s), got), "the form of its row count"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 4096)])
def test_finish_group_of_eight_gpu(n, k):
    """The eight-partial finish (the default at 16 rows) gives the bits of the four-partial one
    at release shapes."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 products before SM89")
    x, w, s = _case(16, n, k, torch.bfloat16)
    eight = H200_STREAM_RULE.pick(n, k)
    four = dataclasses.replace(eight, finish_registers=0)
    assert torch.equal(check(x, w, s, config=eight), fp8_linear_stream(x, w, s, 128, four))
