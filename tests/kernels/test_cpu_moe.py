"""CPU routed experts: Numba against the fp32 reference on random FP8 experts (seed 42)."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.cpu_moe import (
    NumbaMoeExperts,
    RefMoeExperts,
    create_cpu_experts,
    routed_experts_ref,
)
from glmflash.kernels.fp8_gemm import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8

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


def run_numba(weights, x, ids, topk_weights, swiglu_limit: float) -> torch.Tensor:
    experts = NumbaMoeExperts(*weights, swiglu_limit=swiglu_limit, num_threads=2)
    # NaN-poison every scratch buffer and the output: a read before a write shows up as NaN
    experts._reserve(ids.numel())
    for buf in (experts._scratch, experts._acc, experts._h):
        buf.fill(float("nan"))
    out = torch.full((x.shape[0], x.shape[1]), float("nan"))
    return experts.forward(x, ids, topk_weights, out=out)


def assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit: float) -> None:
    want = routed_experts_ref(x, ids, topk_weights, *weights, swiglu_limit=swiglu_limit)
    got = run_numba(weights, x, ids, topk_weights, swiglu_limit)
    scale = want.abs().max().item()
    assert scale > 0
    err = (got - want).abs().max().item()
    assert err <= REL_TOL * scale, f"max err {err:.3g} vs max |ref| {scale:.3g}"


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
@pytest.mark.parametrize("top_k", [1, 8], ids=["k1", "k8"])
def test_numba_matches_ref(shape, num_tokens, top_k, seeded):
    num_experts, hidden, inter = shape
    weights = make_experts(*shape, seeded)
    x = torch.randn(num_tokens, hidden, generator=seeded)
    ids, topk_weights = make_routing(num_tokens, min(top_k, num_experts), num_experts, seeded)
    assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit=10.0)


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


def test_every_e4m3_code_decodes(seeded):
    weights = make_experts(4, 256, 128, seeded, raw_bytes=True)
    x = torch.randn(5, 256, generator=seeded)
    ids, topk_weights = make_routing(5, 2, 4, seeded)
    assert_matches_ref(weights, x, ids, topk_weights, swiglu_limit=10.0)


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
