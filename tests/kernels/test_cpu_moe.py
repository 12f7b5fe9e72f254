"""CPU routed experts: Numba against the fp32 reference on random FP8 experts (seed 42)."""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from glmflash.kernels.cpu_moe import (
    NumbaMoeExperts,
    RefMoeExperts,
    create_cpu_experts,
    pools,
    routed_experts_ref,
)
from glmflash.kernels.fp8_gemm import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from glmflash.model.moe import Experts

# Measured: max |numba - ref| / max |ref| <= 1.1e-6 over these cases (fp32 summation order only).
REL_TOL = 1e-5

# (num_experts, hidden, inter)
SHAPES = {
    "edge-200x72": (8, 200, 72),
    "odd-198x70": (5, 198, 70),
    "x128-256x128": (8, 256, 128),
    "tiny-64x32": (6, 64, 32),
}


def make_experts(num_experts: int, hidden: int, inter: int, gen: torch.Generator,
                 raw_bytes: bool = False) -> tuple[torch.Tensor, ...]:
    """(gate_w, gate_s, up_w, up_s, down_w, down_s); raw_bytes draws every non-NaN e4m3 code."""
    def one(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not raw_bytes:
            return quantize_block_fp8(torch.randn(num_experts, n, k, generator=gen) * 0.5)
        raw = torch.randint(0, 256, (num_experts, n, k), dtype=torch.uint8, generator=gen)
        raw[(raw & 0x7F) == 0x7F] = 0
        scale = torch.rand(num_experts, -(-n // 128), -(-k // 128), generator=gen) * 4e-3 + 1e-4
        return raw.view(FP8_DTYPE), scale
    return (*one(inter, hidden), *one(inter, hidden), *one(hidden, inter))


def make_routing(num_tokens: int, top_k: int, num_experts: int,
                 gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k]
                       for _ in range(num_tokens)])
    return ids, torch.rand(num_tokens, top_k, generator=gen) + 0.1


def run_numba(weights, x, ids, topk_weights, swiglu_limit: float, **options) -> torch.Tensor:
    experts = NumbaMoeExperts(*weights, swiglu_limit=swiglu_limit, num_threads=2, **options)
    # NaN-poison every scratch buffer and the output: a read before a write shows up as NaN
    experts._reserve(ids.numel())
    for buf in (experts._scratch, experts._acc, experts._h):
        buf.fill(float("nan"))
    out = torch.full((x.shape[0], x.shape[1]), float("nan"))
    return experts.forward(x, ids, topk_weights, out=out)


def assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit: float, **options) -> None:
    want = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=swiglu_limit)
    got = run_numba(weights, x, ids, topk_weights, swiglu_limit, **options)
    scale = want.abs().max().item()
    assert scale > 0
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"


DECODES = ["fp32-bits", "fp16"]


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("top_k", [1, 8], ids=["k1", "k8"])
@pytest.mark.parametrize("decode", DECODES)
def test_numba_matches_ref(shape, num_tokens, top_k, decode, seeded):
    num_experts, hidden, inter = shape
    weights = make_experts(*shape, seeded)
    x = torch.randn(num_tokens, hidden, generator=seeded)
    ids, topk_weights = make_routing(num_tokens, min(top_k, num_experts), num_experts, seeded)
    assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit=10.0, decode=decode)


@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_one_expert_hit(num_tokens, seeded):
    weights = make_experts(*SHAPES["edge-200x72"], seeded)
    x = torch.randn(num_tokens, 200, generator=seeded)
    ids = torch.full((num_tokens, 1), 3)
    assert_matches_ref(weights, x, ids, torch.rand(num_tokens, 1, generator=seeded), 10.0)


@pytest.mark.parametrize("shape", ["edge-200x72", "x128-256x128"])
def test_all_experts_hit_with_binding_clamps(shape, seeded):
    num_experts, hidden, inter = SHAPES[shape]
    weights = make_experts(num_experts, hidden, inter, seeded)
    x = torch.randn(17, hidden, generator=seeded)
    ids, topk_weights = make_routing(17, num_experts, num_experts, seeded)
    limit = 0.5
    gate = dequantize_block_fp8(weights[0][0], weights[1][0])
    up = dequantize_block_fp8(weights[2][0], weights[3][0])
    # the clamps must bind for a large share of the pre-activations, or this test proves nothing
    assert ((x @ gate.T) > limit).float().mean() > 0.2
    assert ((x @ up.T).abs() > limit).float().mean() > 0.4
    assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit=limit)


@pytest.mark.parametrize("decode", DECODES)
def test_every_e4m3_code_decodes(decode, seeded):
    weights = make_experts(4, 256, 128, seeded, raw_bytes=True)
    x = torch.randn(5, 256, generator=seeded)
    ids, topk_weights = make_routing(5, 2, 4, seeded)
    assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit=10.0, decode=decode)


def test_decode_choice(monkeypatch, seeded):
    from glmflash.kernels.cpu_moe import decode_choice

    monkeypatch.setenv("GLMFLASH_CPU_MOE_DECODE", "FP16")
    assert decode_choice.default_decode() == "fp16"
    monkeypatch.delenv("GLMFLASH_CPU_MOE_DECODE")
    checkpoint_like = make_experts(4, 256, 128, seeded)[0]
    uniform_codes = make_experts(4, 256, 128, seeded, raw_bytes=True)[0]
    # uniformly random bytes: 14 of 256 codes are subnormal (exponent 0, mantissa 1..7)
    assert abs(decode_choice.subnormal_share(uniform_codes) - 14 / 256) < 0.01
    assert decode_choice.subnormal_share(checkpoint_like) < decode_choice.SUBNORMAL_FP16_SHARE
    for intel in (False, True):
        monkeypatch.setattr(decode_choice, "is_intel", lambda intel=intel: intel)
        assert decode_choice.default_decode(checkpoint_like) == "fp32-bits"
        assert decode_choice.default_decode(uniform_codes) == ("fp16" if intel else "fp32-bits")
        assert NumbaMoeExperts(*make_experts(2, 64, 32, seeded, raw_bytes=True),
                               swiglu_limit=1.0).decode_name == ("fp16" if intel else "fp32-bits")
    # the module samples its own weights: few subnormal codes keep the fp32 bits on Intel too
    monkeypatch.setattr(decode_choice, "is_intel", lambda: True)
    assert NumbaMoeExperts(*make_experts(4, 256, 128, seeded), swiglu_limit=1.0).decode_name \
        == "fp32-bits"
    with pytest.raises(ValueError, match="unknown e4m3 decode 'bf16'"):
        NumbaMoeExperts(*make_experts(2, 64, 32, seeded), swiglu_limit=1.0, decode="bf16")


def test_ref_matches_per_token_loop(seeded):
    num_experts, hidden, inter = SHAPES["edge-200x72"]
    weights = make_experts(num_experts, hidden, inter, seeded)
    x = torch.randn(3, hidden, generator=seeded)
    ids, topk_weights = make_routing(3, 2, num_experts, seeded)
    dense = [dequantize_block_fp8(w, s) for w, s in zip(weights[0::2], weights[1::2], strict=True)]
    want = torch.zeros(3, hidden)
    for t in range(3):
        for e, w in zip(ids[t].tolist(), topk_weights[t].tolist(), strict=True):
            a = (x[t] @ dense[0][e].T).clamp(max=1.0)
            b = (x[t] @ dense[1][e].T).clamp(-1.0, 1.0)
            want[t] += w * ((torch.nn.functional.silu(a) * b) @ dense[2][e].T)
    got = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=1.0)
    torch.testing.assert_close(got, want, rtol=0, atol=REL_TOL * want.abs().max().item())


@pytest.mark.parametrize("num_tokens", [2, 3, 17])
def test_negative_ids_are_skipped(num_tokens, seeded):
    num_experts, hidden, inter = SHAPES["edge-200x72"]
    weights = make_experts(num_experts, hidden, inter, seeded)
    x = torch.randn(num_tokens, hidden, generator=seeded)
    ids, topk_weights = make_routing(num_tokens, 4, num_experts, seeded)
    skip = torch.rand(ids.shape, generator=seeded) < 0.5
    skip[-1] = True  # a token whose experts all run elsewhere
    skip[0, 0] = False
    masked = ids.masked_fill(skip, -1)
    # Skipping a pair is routing it with weight 0 (up to the ref's fp32 summation order).
    want = routed_experts_ref(x, ids, topk_weights.masked_fill(skip, 0.0), *weights,
                              swiglu_limit=10.0)
    atol = REL_TOL * max(want.abs().max().item(), 1.0)
    ref = routed_experts_ref(x, masked, topk_weights, *weights, swiglu_limit=10.0)
    torch.testing.assert_close(ref, want, rtol=0, atol=atol)
    got = run_numba(weights, x, masked, topk_weights, 10.0)
    assert torch.equal(got[-1], torch.zeros(hidden))
    assert (got - want).abs().max().item() <= atol


def test_all_ids_negative_gives_zeros(seeded):
    weights = make_experts(*SHAPES["tiny-64x32"], seeded)
    ids = torch.full((3, 2), -1)
    got = run_numba(weights, torch.randn(3, 64, generator=seeded), ids, torch.ones(3, 2), 10.0)
    assert torch.equal(got, torch.zeros(3, 64))


def test_bad_expert_id_is_rejected(seeded):
    weights = make_experts(*SHAPES["tiny-64x32"], seeded)
    experts = NumbaMoeExperts(*weights, swiglu_limit=10.0)
    with pytest.raises(ValueError):
        experts.forward(torch.randn(1, 64), torch.tensor([[6]]), torch.ones(1, 1))


def test_create_picks_impl(seeded, monkeypatch):
    weights = make_experts(*SHAPES["tiny-64x32"], seeded)
    assert isinstance(create_cpu_experts(*weights, swiglu_limit=10.0), NumbaMoeExperts)
    monkeypatch.setenv("GLMFLASH_KERNEL_CPU_MOE", "ref")
    experts = create_cpu_experts(*weights, swiglu_limit=10.0)
    assert isinstance(experts, RefMoeExperts)
    x = torch.randn(2, 64, generator=seeded)
    ids, topk_weights = make_routing(2, 2, 6, seeded)
    want = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=10.0)
    torch.testing.assert_close(experts.forward(x, ids, topk_weights), want)


# (num_experts, hidden, inter): rows that do not split evenly into 2 pools or into blocks
POOL_SHAPES = {
    "odd-198x70": (5, 198, 70),
    "blocks-3-384x384": (4, 384, 384),
    "edge-200x72": (8, 200, 72),
}


@pytest.mark.parametrize("shape", POOL_SHAPES.values(), ids=POOL_SHAPES.keys())
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_two_pools_equal_one_pool_bit_for_bit(shape, num_tokens, seeded):
    num_experts, hidden, _ = shape
    weights = make_experts(*shape, seeded)
    x = torch.randn(num_tokens, hidden, generator=seeded)
    ids, topk_weights = make_routing(num_tokens, 3, num_experts, seeded)
    one = run_numba(weights, x, ids, topk_weights, 10.0)
    two = run_numba(weights, x, ids, topk_weights, 10.0, num_pools=2)
    assert torch.equal(one, two)
    want = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=10.0)
    assert (two - want).abs().max() <= REL_TOL * want.abs().max()


@pytest.mark.parametrize("num_pools", [0, 3])
def test_pools_need_a_thread_each(num_pools, seeded):
    weights = make_experts(*SHAPES["tiny-64x32"], seeded)
    with pytest.raises(ValueError, match="every pool needs a thread"):
        NumbaMoeExperts(*weights, swiglu_limit=10.0, num_threads=2, num_pools=num_pools)


@pytest.mark.parametrize("shape", POOL_SHAPES.values(), ids=POOL_SHAPES.keys())
def test_every_row_is_computed_by_its_own_pool(shape, seeded):
    num_experts, hidden, inter = shape
    experts = NumbaMoeExperts(*make_experts(*shape, seeded), swiglu_limit=10.0, num_threads=2,
                              num_pools=2)
    experts.record_workers = True
    ids, topk_weights = make_routing(5, 3, num_experts, seeded)
    experts.forward(torch.randn(5, hidden, generator=seeded), ids, topk_weights)
    trace = experts.worker_trace
    assert trace.hit_ids.tolist() == ids.unique().tolist()
    worker_pool = pools.pool_of_workers(2, 2)
    for workers, num_rows in ((trace.gate_up, inter), (trace.down, hidden)):
        owner = np.searchsorted(pools.split_rows(num_rows, 2, 128, 4), np.arange(num_rows),
                                side="right") - 1
        assert (workers >= 0).all(), "a row was never computed"
        assert (worker_pool[workers] == owner).all()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_pinned_pools_leave_the_caller_unpinned(seeded):
    weights = make_experts(*POOL_SHAPES["odd-198x70"], seeded)
    x = torch.randn(3, 198, generator=seeded)
    ids, topk_weights = make_routing(3, 2, 5, seeded)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    before = os.sched_getaffinity(0)
    pinned = run_numba(weights, x, ids, topk_weights, 10.0, num_pools=2,
                       pool_cpus=[[first], [second]])
    assert os.sched_getaffinity(0) == before
    assert torch.equal(pinned, run_numba(weights, x, ids, topk_weights, 10.0))
    # the second worker is an OpenMP thread of its own, pinned to pool 1's CPU
    assert str(second) in _thread_cpu_lists()


def _thread_cpu_lists() -> list[str]:
    tasks = Path(f"/proc/{os.getpid()}/task").iterdir()
    lines = [line for task in tasks for line in (task / "status").read_text().splitlines()]
    return [line.split(":")[1].strip() for line in lines if line.startswith("Cpus_allowed_list")]


def test_pool_layout_helpers():
    assert pools.split_rows(384, 2, 128, 4).tolist() == [0, 128, 384]
    assert pools.split_rows(70, 2, 128, 4).tolist() == [0, 36, 70]
    assert pools.split_rows(2048, 3, 128, 4).tolist() == [0, 640, 1280, 2048]
    assert pools.split_rows(4096, 1, 128, 4).tolist() == [0, 4096]
    assert pools.pool_of_workers(5, 2).tolist() == [0, 0, 0, 1, 1]
    assert pools.parse_cpu_list("0-2,8,10-11\n") == [0, 1, 2, 8, 10, 11]
    assert pools.format_cpus([0, 1, 2, 8, 10, 11]) == "0-2,8,10-11"
    four_nodes = [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert pools.pool_cpus(2, four_nodes) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pools.pool_cpus(3, four_nodes) is None
    assert pools.pool_cpus(1, four_nodes) is None
    masks = pools.cpu_masks([[0, 65], [1]])
    assert masks.shape == (2, 16) and masks[0, :2].tolist() == [1, 2] and masks[1, 0] == 2


@pytest.mark.parametrize("num_pools", [1, 2])
def test_experts_module_holds_the_only_copy_of_the_weights(num_pools, seeded):
    num_experts, hidden, inter = POOL_SHAPES["odd-198x70"]
    config = SimpleNamespace(n_routed_experts=num_experts, hidden_size=hidden,
                             moe_intermediate_size=inter, swiglu_limit=10.0)
    module = Experts(config, torch.float32, fp8_block=128)
    weights = make_experts(num_experts, hidden, inter, seeded)
    projections = (module.gate_proj, module.up_proj, module.down_proj)
    loaded = []
    for proj, weight, scale in zip(projections, weights[0::2], weights[1::2], strict=True):
        # numpy owns the loaded bytes, so a weak reference tells when torch lets go of them
        owner = weight.view(torch.uint8).numpy().copy()
        proj.weight.data = torch.from_numpy(owner).view(FP8_DTYPE)
        proj.weight_scale_inv.data = scale
        loaded.append(weakref.ref(owner))
        del owner
    kernel = module.build_cpu_kernel(num_threads=2, num_pools=num_pools)
    gc.collect()
    assert [ref() is None for ref in loaded] == [num_pools > 1] * 3
    for proj, placed, weight in zip(projections, kernel.weight_tensors, weights[0::2],
                                    strict=True):
        assert proj.weight.data_ptr() == placed.data_ptr()
        assert torch.equal(placed.view(torch.uint8), weight.view(torch.uint8))
    x = torch.randn(3, hidden, generator=seeded)
    ids, topk_weights = make_routing(3, 2, num_experts, seeded)
    want = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=10.0)
    assert (module(x, ids, topk_weights) - want).abs().max() <= REL_TOL * want.abs().max()


def test_engine_with_two_pools_generates_the_same_tokens():
    from glmflash import Engine, SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[11, 12, 13, 14, 15], list(range(100, 131))]
    tokens = []
    for num_pools in (1, 2):
        engine = Engine(None, device="cpu", dtype="float32", kt_cpuinfer=2,
                        kt_threadpool_count=num_pools, max_running_requests=2,
                        background_loop=False)
        kernels = [m.cpu_kernel for m in engine.runner.model.modules() if isinstance(m, Experts)]
        assert kernels and all(k.num_pools == num_pools for k in kernels)
        tokens.append([r.token_ids for r in engine.generate(prompt_token_ids=prompts,
                                                             sampling_params=params)])
    assert tokens[0] == tokens[1]
