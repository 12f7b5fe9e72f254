"""Triton mHC pre/post against hyper/ref.py (interpreter on CPU, compiled with CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from glmflash.kernels import hyper
from glmflash.kernels.fused_moe.expert_rows import ExpertRows, sum_rows
from glmflash.kernels.hyper import hyper_post_ref, hyper_pre_ref, triton_impl
from glmflash.kernels.hyper.triton_impl import (
    HyperPostConfig,
    HyperPreConfig,
    hyper_post,
    hyper_pre,
)
from glmflash.kernels.rms_norm import rms_norm_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
KW = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
# fp32 post / comb: summation order, and the norm applied after the product instead of before
# (measured 8e-7 / 3e-7).
WEIGHTS_ATOL = 5e-6
# fp32 collapsed and post outputs, relative to the token's largest stream value (measured 4e-7
# and 2e-6: the reference's product-then-add against one fp32 sum).
FP32_RTOL = 1e-5
# bf16 outputs against a one-rounding fp32 result: one ulp (relative 2^-7) where a value sits at
# a rounding boundary that fp32 summation order moves it across; such flips stay rare.
ONE_ULP = 2.0**-7
COLLAPSE_FP32_ERROR = 2.0**-20  # four fp32 roundings of four products, each <= the token's max
MAX_FLIPS = 0.01
# bf16 post against the bf16 reference, which rounds post * y, the mix and their sum (and,
# under the interpreter, the kernel's weights are truncated): relative to the token's largest
# stream value, measured 0.032.
BF16_POST_VS_REF = 0.05
# GPU, release shapes, against the reference in fp32: half an ulp of bf16 (rounding to nearest)
# plus the fp32 error, at most 1e-4 of the token's largest stream value (the pre weights are off
# by ~1e-5 after 16384 exact bf16 products summed in fp32 in another order, times 4 streams).
GPU_BF16_RTOL, GPU_TOKEN_ATOL, GPU_WEIGHTS_ATOL = 2.0**-8, 1e-4, 1e-4


def _case(tokens, s, d, dtype, seed=42, device=DEVICE):
    """Streams with per-token scales over two decades, and fn / base / scale whose weights are
    far from uniform, so Sinkhorn's later iterations still move comb."""
    gen = torch.Generator().manual_seed(seed)
    n = (2 + s) * s
    token_scale = 10 ** (torch.rand(tokens, 1, 1, generator=gen) * 2 - 1)
    streams = (torch.randn(tokens, s, d, generator=gen) * token_scale).to(dtype)
    fn = (torch.randn(n, s * d, generator=gen) * 2 / (s * d) ** 0.5).to(dtype)
    base = torch.randn(n, generator=gen) * 0.5
    scale = 1 + 0.2 * torch.randn(3, generator=gen)
    y = (torch.randn(tokens, d, generator=gen) * token_scale[:, 0]).to(dtype)
    return [t.to(device) for t in (streams, fn, base, scale, y)]


def _round(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> dtype as the kernels round: to nearest even on a GPU; the interpreter truncates
    fp32 -> bf16 (it ignores the rounding mode)."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return (t.float().view(torch.int32) & -65536).view(torch.float32).to(dtype)
    return t.to(dtype)


def _token_max(streams: torch.Tensor) -> torch.Tensor:
    return streams.float().abs().amax(dim=(1, 2))


def _assert_rounded_once(got: torch.Tensor, want32: torch.Tensor) -> None:
    """got == want32 rounded once to got's dtype, up to rare one-ulp boundary flips."""
    expected = _round(want32, got.dtype).float()
    diff = (got.float() - expected).abs()
    assert (diff <= ONE_ULP * expected.abs() + 1e-30).all(), diff.max().item()
    assert (diff > 0).float().mean().item() < MAX_FLIPS


def _assert_pre_fp32(got, want, streams) -> None:
    assert (got[0] - want[0]).abs().max().item() < WEIGHTS_ATOL
    assert (got[1] - want[1]).abs().max().item() < WEIGHTS_ATOL
    err = (got[2] - want[2]).abs().amax(dim=1) / _token_max(streams)
    assert err.max().item() < FP32_RTOL


PRE_SHAPES = {f"T{t}_S{s}_D{d}": (t, s, d) for t in (1, 3, 17) for s, d in
              ((4, 64), (4, 192), (4, 200), (2, 200))}
# Past DECODE_TOKENS: the default takes tensor-core token blocks.
PRE_SHAPES["T70_S4_D64_prefill"] = (70, 4, 64)


@pytest.mark.parametrize("shape", PRE_SHAPES.values(), ids=PRE_SHAPES.keys())
def test_hyper_pre_fp32(shape, nan_empty):
    streams, fn, base, scale, _ = _case(*shape, torch.float32)
    got = hyper_pre(streams, fn, base, scale, **KW)
    _assert_pre_fp32(got, hyper_pre_ref(streams, fn, base, scale, **KW), streams)


# Token blocks by FMA and on tensor cores, one range or several (the last one shorter; more
# than the finish loads at once), a token block with one live token, collapse steps with a
# feature tail.
PRE_CONFIGS = {
    "fma_bt1_one_range": HyperPreConfig(block_t=1, block_k=128, block_d=64, splits=1),
    "fma_bt4_7_ranges": HyperPreConfig(block_t=4, block_k=32, block_d=64, splits=7),
    # 25 ranges of 4-token blocks: the finish loads 16 ranges' partials at once, then 9.
    "fma_bt4_25_ranges": HyperPreConfig(block_t=4, block_k=32, block_d=64, splits=25),
    "fma_bt2_default_ranges": HyperPreConfig(block_t=2, block_k=64, block_d=128),
    "dot_bt16_3_ranges": HyperPreConfig(block_t=16, block_k=64, block_d=32, splits=3),
    "dot_bt32_one_range": HyperPreConfig(block_t=32, block_k=16, block_d=16, splits=1),
    # The finish loading its first chunk of streams after the weights, not before them.
    "fma_bt4_7_ranges_late_streams": HyperPreConfig(block_t=4, block_k=32, block_d=64, splits=7,
                                                    prefetch_streams=False),
}


@pytest.mark.parametrize("config", PRE_CONFIGS.values(), ids=PRE_CONFIGS.keys())
def test_hyper_pre_launch_shapes(config, nan_empty):
    streams, fn, base, scale, _ = _case(17, 4, 200, torch.float32)
    got = hyper_pre(streams, fn, base, scale, **KW, config=config)
    _assert_pre_fp32(got, hyper_pre_ref(streams, fn, base, scale, **KW), streams)


@pytest.mark.parametrize("config", [None, PRE_CONFIGS["dot_bt16_3_ranges"]], ids=["default", "dot"])
@pytest.mark.parametrize("shape", [(1, 4, 64), (17, 4, 200), (3, 2, 192)],
                         ids=["T1_S4_D64", "T17_S4_D200", "T3_S2_D192"])
def test_hyper_pre_bf16(shape, config, nan_empty):
    streams, fn, base, scale, _ = _case(*shape, torch.bfloat16)
    post, comb, collapsed = hyper_pre(streams, fn, base, scale, **KW, config=config)
    want = hyper_pre_ref(streams, fn, base, scale, **KW)
    assert collapsed.dtype == torch.bfloat16
    assert (post - want[0]).abs().max().item() < WEIGHTS_ATOL
    assert (comb - want[1]).abs().max().item() < WEIGHTS_ATOL
    _assert_rounded_once(collapsed, hyper_pre_ref(streams.float(), fn.float(), base, scale,
                                                  **KW)[2])
    # Against the bf16 reference itself: within one ulp (measured: one ulp, from the
    # interpreter's truncation; the GPU rounds to nearest).
    diff = (collapsed.float() - want[2].float()).abs()
    assert (diff <= ONE_ULP * want[2].float().abs()).all()


def _norm_weight(d: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    return (1 + 0.5 * torch.randn(d, generator=gen)).to(dtype).to(DEVICE)


NORM_CONFIGS = {"default": None, "dot_bt16_3_ranges": PRE_CONFIGS["dot_bt16_3_ranges"],
                "fma_bt4_late_streams": PRE_CONFIGS["fma_bt4_7_ranges_late_streams"]}


@pytest.mark.parametrize("config", NORM_CONFIGS.values(), ids=NORM_CONFIGS.keys())
@pytest.mark.parametrize("shape", [(1, 4, 64), (17, 4, 200), (3, 2, 192)],
                         ids=["T1_S4_D64", "T17_S4_D200", "T3_S2_D192"])
def test_hyper_pre_with_the_input_norm_fp32(shape, config, nan_empty):
    """The collapsed rows normalised in the same launch equal the sub-layer's RMSNorm of the
    unnormalised rows, up to the order of the sum of squares (over chunks of `block_d`)."""
    streams, fn, base, scale, _ = _case(*shape, torch.float32)
    weight = _norm_weight(shape[2], torch.float32)
    post, comb, normed = hyper_pre(streams, fn, base, scale, **KW, config=config,
                                   norm=(weight, 1e-6))
    want = hyper_pre(streams, fn, base, scale, **KW, config=config)
    assert torch.equal(post, want[0]) and torch.equal(comb, want[1])
    torch.testing.assert_close(normed, rms_norm_ref(want[2], weight, 1e-6), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("config", NORM_CONFIGS.values(), ids=NORM_CONFIGS.keys())
def test_hyper_pre_with_the_input_norm_bf16(config, nan_empty):
    """bf16: the reference's two roundings (normalised row, then the weight product), each as
    the kernels round, up to rare one-ulp flips of the first where the sum of squares' order
    moves a value across a rounding boundary."""
    streams, fn, base, scale, _ = _case(17, 4, 200, torch.bfloat16)
    weight = _norm_weight(200, torch.bfloat16)
    normed = hyper_pre(streams, fn, base, scale, **KW, config=config, norm=(weight, 1e-6))[2]
    rows = hyper_pre(streams, fn, base, scale, **KW, config=config)[2].float()
    rstd = torch.rsqrt(rows.square().mean(-1, keepdim=True) + 1e-6)
    expected = _round(weight.float() * _round(rows * rstd, torch.bfloat16).float(),
                      torch.bfloat16).float()
    diff = (normed.float() - expected).abs()
    assert (diff <= 2 * ONE_ULP * expected.abs() + 1e-30).all(), diff.max().item()
    assert (diff > 0).float().mean().item() < MAX_FLIPS


def test_hyper_pre_with_the_input_norm_reference_dispatch():
    """The CPU path: the reference collapse, then the reference norm."""
    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    streams, fn, base, scale, _ = _case(3, 4, 64, torch.float32)
    weight = _norm_weight(64, torch.float32)
    got = hyper.hyper_pre(streams, fn, base, scale, **KW, norm=(weight, 1e-6))
    want = hyper_pre_ref(streams, fn, base, scale, **KW)
    assert torch.equal(got[2], rms_norm_ref(want[2], weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hyper_post_adds_a_second_block_output(dtype, nan_empty):
    """`extra` (a MoE's shared expert output) is added to the block output first, rounded as
    the kernels round: then the same bits as the post of the rounded sum."""
    streams, fn, base, scale, y = _case(3, 4, 200, dtype)
    y2 = (torch.randn(y.shape, generator=torch.Generator().manual_seed(8)) * 3).to(dtype)
    y2 = y2.to(y.device)
    post, comb, _ = hyper_pre(streams, fn, base, scale, **KW)
    got = hyper_post(y, streams, post, comb, extra=y2)
    summed = _round(y.float() + y2.float(), dtype)
    assert torch.equal(got, hyper_post(summed, streams, post, comb))
    assert not torch.equal(got, hyper_post(y, streams, post, comb))


def _expert_rows(tokens: int, d: int, dtype: torch.dtype) -> ExpertRows:
    """Three slots a token over 5 experts, two of them skipped (-1 and 5); the skipped pairs'
    rows NaN (never written by the MoE: never read)."""
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, 5, (tokens, 3), generator=gen)
    ids[0, 1], ids[-1, 2] = -1, 5
    rows = (torch.randn(tokens * 3, d, generator=gen) * 2).to(dtype)
    rows[(ids.view(-1) < 0) | (ids.view(-1) >= 5)] = float("nan")
    weights = torch.rand(tokens, 3, generator=gen)
    return ExpertRows(rows.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), 5)


@pytest.mark.parametrize("extra", [False, True], ids=["alone", "with_shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hyper_post_sums_the_routed_rows(dtype, extra, nan_empty):
    """Routed experts' rows before their sum (`ExpertRows`): the bits of the sum's own launch
    followed by the post, with and without the shared expert's output."""
    streams, fn, base, scale, y = _case(5, 4, 200, dtype)
    post, comb, _ = hyper_pre(streams, fn, base, scale, **KW)
    routed = _expert_rows(5, 200, dtype)
    shared = y if extra else None
    got = hyper_post(routed, streams, post, comb, extra=shared)
    assert torch.equal(got, hyper_post(sum_rows(routed), streams, post, comb, extra=shared))
    assert not got.isnan().any()


def test_hyper_post_routed_rows_reference_dispatch(monkeypatch):
    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    monkeypatch.setenv("GLMFLASH_KERNEL_HYPER", "ref")
    streams, fn, base, scale, y = _case(5, 4, 64, torch.float32)
    post, comb, _ = hyper_pre_ref(streams, fn, base, scale, **KW)
    routed = _expert_rows(5, 64, torch.float32)
    got = hyper.hyper_post(routed, streams, post, comb, extra=y)
    assert torch.equal(got, hyper_post_ref(sum_rows(routed) + y, streams, post, comb))


def test_hyper_post_second_output_reference_dispatch():
    if DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    streams, fn, base, scale, y = _case(3, 4, 64, torch.float32)
    post, comb, _ = hyper_pre_ref(streams, fn, base, scale, **KW)
    got = hyper.hyper_post(y, streams, post, comb, extra=2 * y)
    assert torch.equal(got, hyper_post_ref(y + 2 * y, streams, post, comb))


def test_sinkhorn_is_not_trivial_here():
    """The cases above would catch a wrong iteration count: comb moves after the first step."""
    streams, fn, base, scale, _ = _case(17, 4, 200, torch.float32)
    comb = hyper_pre_ref(streams, fn, base, scale, **KW)[1]
    once = hyper_pre_ref(streams, fn, base, scale, **{**KW, "sinkhorn_iters": 2})[1]
    assert (comb - once).abs().max().item() > 100 * WEIGHTS_ATOL
    assert comb.std().item() > 0.1


def test_hyper_pre_ranges_are_deterministic_and_reset_counters(nan_empty):
    streams, fn, base, scale, _ = _case(3, 4, 200, torch.float32)
    config = PRE_CONFIGS["fma_bt4_7_ranges"]
    first = hyper_pre(streams, fn, base, scale, **KW, config=config)
    again = hyper_pre(streams, fn, base, scale, **KW, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not triton_impl._ARRIVALS[streams.device].any()


POST_SHAPES = {f"T{t}_S{s}_D{d}": (t, s, d) for t in (1, 3, 17) for s, d in
               ((4, 64), (4, 200), (2, 192))}


def _post_inputs(shape, dtype):
    streams, fn, base, scale, y = _case(*shape, dtype)
    post, comb, _ = hyper_pre_ref(streams, fn, base, scale, **KW)
    return y, streams, post, comb


@pytest.mark.parametrize("config", [None, HyperPostConfig(block_d=16)], ids=["default", "bd16"])
@pytest.mark.parametrize("shape", POST_SHAPES.values(), ids=POST_SHAPES.keys())
def test_hyper_post_fp32(shape, config, nan_empty):
    y, streams, post, comb = _post_inputs(shape, torch.float32)
    got = hyper_post(y, streams, post, comb, config=config)
    want = hyper_post_ref(y, streams, post, comb)
    err = (got - want).abs().amax(dim=(1, 2)) / _token_max(streams)
    assert err.max().item() < FP32_RTOL


@pytest.mark.parametrize("shape", [(1, 4, 64), (17, 4, 200), (3, 2, 192)],
                         ids=["T1_S4_D64", "T17_S4_D200", "T3_S2_D192"])
def test_hyper_post_bf16(shape, nan_empty):
    y, streams, post, comb = _post_inputs(shape, torch.bfloat16)
    got = hyper_post(y, streams, post, comb)
    assert got.dtype == torch.bfloat16
    # The weights rounded to bf16 first (spec §2.2 step 8), then one fp32 sum and one rounding.
    want32 = hyper_post_ref(y.float(), streams.float(), _round(post, torch.bfloat16).float(),
                            _round(comb, torch.bfloat16).float())
    _assert_rounded_once(got, want32)
    want = hyper_post_ref(y, streams, post, comb).float()
    err = (got.float() - want).abs().amax(dim=(1, 2)) / _token_max(streams)
    assert err.max().item() < BF16_POST_VS_REF


def test_no_tokens(nan_empty):
    streams, fn, base, scale, y = _case(0, 4, 64, torch.float32)
    post, comb, collapsed = hyper_pre(streams, fn, base, scale, **KW)
    assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and collapsed.shape == (0, 64)
    assert hyper_post(y, streams, post, comb).shape == (0, 4, 64)


def _counting(calls: list[str], name: str, real):
    def run(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    return run


@pytest.mark.parametrize("choice", ["triton", "ref", None])
def test_dispatch(choice, monkeypatch):
    """GLMFLASH_KERNEL_HYPER picks the implementation; without it CPU tensors take the ref."""
    calls = []
    for name in ("hyper_pre", "hyper_post"):
        monkeypatch.setattr(triton_impl, name, _counting(calls, name, getattr(triton_impl, name)))
    if choice is None:
        monkeypatch.delenv("GLMFLASH_KERNEL_HYPER", raising=False)
    else:
        monkeypatch.setenv("GLMFLASH_KERNEL_HYPER", choice)
    streams, fn, base, scale, y = _case(3, 4, 64, torch.float32)
    post, comb, _ = hyper.hyper_pre(streams, fn, base, scale, **KW)
    hyper.hyper_post(y, streams, post, comb)
    use_triton = choice == "triton" or (choice is None and streams.is_cuda)
    assert calls == (["hyper_pre", "hyper_post"] if use_triton else [])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32, 2048], ids=lambda t: f"T{t}")
def test_hyper_release_shape_gpu(tokens):
    streams, fn, base, scale, y = _case(tokens, 4, 4096, torch.bfloat16, device="cuda")
    post, comb, collapsed = hyper_pre(streams, fn, base, scale, **KW)
    want = hyper_pre_ref(streams.float(), fn.float(), base, scale, **KW)
    assert (post - want[0]).abs().max().item() < GPU_WEIGHTS_ATOL
    assert (comb - want[1]).abs().max().item() < GPU_WEIGHTS_ATOL
    _assert_rounded_to_nearest(collapsed, want[2], streams)
    got = hyper_post(y, streams, post, comb)
    want32 = hyper_post_ref(y.float(), streams.float(), post.bfloat16().float(),
                            comb.bfloat16().float())
    _assert_rounded_to_nearest(got, want32, streams)
    # The input norm in the same launch: the reference's two roundings of the kernel's own
    # rows, up to rare one-ulp flips (the sum of squares in another order), and, where the
    # streams cancel, the collapse's own fp32 rounding: the kernel with the norm is another
    # compilation, whose four products may contract into FMAs otherwise (on the H200 at 2048
    # tokens, 3 values near 1e-6 in rows whose streams reach 5 moved by 2-3 bf16 ulps, 2^-27
    # of the row's largest stream value; the bound is that of the sum's roundings).
    weight = _norm_weight(4096, torch.bfloat16)
    normed = hyper_pre(streams, fn, base, scale, **KW, norm=(weight, 1e-6))[2]
    expected = rms_norm_ref(collapsed, weight, 1e-6).float()
    diff = (normed.float() - expected).abs()
    rstd = collapsed.float().square().mean(-1, keepdim=True).add(1e-6).rsqrt()
    cancelled = COLLAPSE_FP32_ERROR * _token_max(streams)[:, None] * rstd * weight.float().abs()
    assert (diff <= 2 * ONE_ULP * expected.abs() + cancelled).all(), diff.max().item()
    assert (diff > 0).float().mean().item() < MAX_FLIPS


def _assert_rounded_to_nearest(got: torch.Tensor, want32: torch.Tensor,
                               streams: torch.Tensor) -> None:
    excess = (got.float() - want32).abs() - GPU_BF16_RTOL * want32.abs()
    excess = excess.reshape(len(streams), -1).amax(dim=1) / _token_max(streams)
    assert excess.max().item() < GPU_TOKEN_ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 32], ids=lambda t: f"T{t}")
def test_hyper_cuda_graph_replay_gpu(tokens):
    """No host reads in the launchers: both capture, and replays give the eager bits (the split
    reduction adds its ranges in a fixed order)."""
    streams, fn, base, scale, y = _case(tokens, 4, 4096, torch.bfloat16, device="cuda")
    eager_pre = hyper_pre(streams, fn, base, scale, **KW)
    eager_post = hyper_post(y, streams, eager_pre[0], eager_pre[1])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pre = hyper_pre(streams, fn, base, scale, **KW)
        new_streams = hyper_post(y, streams, pre[0], pre[1])
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(pre, eager_pre, strict=True))
    assert torch.equal(new_streams, eager_post)
