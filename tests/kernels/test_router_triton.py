"""Triton MoE routing against router/ref.py: the same experts and weights per token (order
within a token may differ). Interpreter on the CPU, compiled with CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glmflash.kernels.router import RouterSpec, route_ref, triton_impl
from glmflash.kernels.router.triton_impl import (
    SCORE_TOKENS,
    ScoreConfig,
    default_score_config,
    route,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (experts, hidden, spec): the release's one group, the tiny model's two groups keeping one,
# four groups keeping two without renormalising, an odd hidden size, five groups of six
# experts (neither a power of two) keeping every group, and top-k taking every kept expert.
SPECS = {
    "release_like": (288, 256, RouterSpec(8, 1, 1, True, 2.5)),
    "tiny": (8, 64, RouterSpec(2, 2, 1, True, 2.5)),
    "four_groups": (64, 96, RouterSpec(6, 4, 2, False, 1.0)),
    "odd_hidden": (24, 100, RouterSpec(3, 3, 2, True, 1.5)),
    "five_groups_all_kept": (30, 48, RouterSpec(7, 5, 5, True, 1.0)),
    "every_kept_expert": (12, 32, RouterSpec(6, 4, 2, True, 1.0)),
}


def _case(tokens, experts, hidden, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    weight = (torch.randn(experts, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    bias = 0.1 * torch.randn(experts, generator=gen)
    return [t.to(DEVICE) for t in (x, weight, bias)]


def _sorted(ids, weights):
    order = ids.argsort(dim=1)
    return ids.gather(1, order), weights.gather(1, order)


def _check(tokens, name, dtype=torch.float32, config=None):
    experts, hidden, spec = SPECS[name]
    x, weight, bias = _case(tokens, experts, hidden, dtype)
    want = _sorted(*route_ref(x, weight, bias, spec=spec))
    got = _sorted(*route(x, weight, bias, spec=spec, score_config=config))
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
    return got[0]


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("tokens", [1, 5])
def test_same_experts_and_weights(tokens, name):
    ids = _check(tokens, name)
    assert ids.shape == (tokens, SPECS[name][2].top_k)
    assert (ids.diff(dim=1) > 0).all()  # k distinct experts


@pytest.mark.parametrize("name", ["release_like", "five_groups_all_kept"])
def test_scores_by_gemm_above_score_tokens(name):
    # Past SCORE_TOKENS the scores are the reference's fp32 GEMM, the choice still the kernel.
    _check(SCORE_TOKENS + 1, name)


def test_bf16_and_a_narrow_launch():
    _check(5, "release_like", torch.bfloat16, ScoreConfig(block_t=2, block_e=4, block_k=64))


def test_group_limit_binds():
    # Group 0's experts score highest, but the bias lifts group 1's best pair above them: with
    # one group kept, every choice comes from group 1.
    experts, hidden, spec = SPECS["tiny"]
    x, weight, _ = _case(4, experts, hidden, torch.float32)
    bias = torch.tensor([0.0] * 4 + [5.0, 5.0, -5.0, -5.0], device=DEVICE)
    ids, _ = route(x, weight, bias, spec=spec)
    assert ((ids >= 4) & (ids < 6)).all()
    assert torch.equal(_sorted(ids, ids.float())[0],
                       _sorted(*route_ref(x, weight, bias, spec=spec))[0])


@pytest.mark.parametrize("tokens", [3, 1, SCORE_TOKENS + 1])
@pytest.mark.parametrize("name", ["release_like", "every_kept_expert", "four_groups"])
def test_nan_scores_still_choose_distinct_real_experts(name, tokens):
    """Also with groups (a NaN token's groups all score alike) and from every launch form."""
    experts, hidden, spec = SPECS[name]
    x, weight, bias = _case(tokens, experts, hidden, torch.float32)
    x[tokens // 2] = float("nan")
    ids, weights = route(x, weight, bias, spec=spec)
    assert ((ids >= 0) & (ids < experts)).all()
    assert all(len(set(row)) == spec.top_k for row in ids.tolist())
    others = torch.arange(tokens) != tokens // 2
    assert weights[tokens // 2].isnan().all() and not weights[others].isnan().any()


def _two_launches(tokens: int) -> ScoreConfig:
    return dataclasses.replace(default_score_config(tokens), fused_select=False)


def _one_launch(tokens: int) -> ScoreConfig:
    return dataclasses.replace(default_score_config(tokens), fused_select=True)


@pytest.mark.parametrize("tokens,name", [(1, "release_like"), (5, "release_like"),
                                         (5, "four_groups"), (SCORE_TOKENS, "four_groups")])
def test_choice_in_the_scores_launch_equals_its_own_launch(tokens, name, monkeypatch):
    """The last expert block of each token block chooses (ragged last block at 5 tokens): the
    choices of the separate launch bit for bit, no second launch, the counters back at zero."""
    experts, hidden, spec = SPECS[name]
    x, weight, bias = _case(tokens, experts, hidden, torch.float32)
    want = route(x, weight, bias, spec=spec, score_config=_two_launches(tokens))
    monkeypatch.setattr(triton_impl, "router_select_kernel", None)  # a launch would fail
    got = route(x, weight, bias, spec=spec, score_config=_one_launch(tokens))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert int(triton_impl._ARRIVALS[x.device].count_nonzero()) == 0


def test_no_tokens():
    experts, hidden, spec = SPECS["tiny"]
    x, weight, bias = _case(0, experts, hidden, torch.float32)
    ids, weights = route(x, weight, bias, spec=spec)
    assert ids.shape == (0, 2) and weights.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 64, 100])
def test_release_shape_bf16(tokens):
    experts, spec = 288, RouterSpec(8, 1, 1, True, 2.5)
    x, weight, bias = _case(tokens, experts, 4096, torch.bfloat16)
    want = _sorted(*route_ref(x, weight, bias, spec=spec))
    got = _sorted(*route(x, weight, bias, spec=spec))
    # fp32 sums of exact products in another order: a choice could flip only at a near tie.
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    if tokens <= SCORE_TOKENS:
        # Which expert block arrives last varies from call to call here; the choice must not.
        two = route(x, weight, bias, spec=spec, score_config=_two_launches(tokens))
        for _ in range(10):
            again = route(x, weight, bias, spec=spec, score_config=_one_launch(tokens))
            assert torch.equal(again[0], two[0]) and torch.equal(again[1], two[1])
        assert int(triton_impl._ARRIVALS[x.device].count_nonzero()) == 0
