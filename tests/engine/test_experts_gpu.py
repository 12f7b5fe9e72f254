"""Hybrid CPU/GPU experts and layerwise prefill vs all experts on the GPU (tiny model)."""

from __future__ import annotations

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.engine.model_runner import load_model
from glmflash.engine.options import EngineConfig
from tests.conftest import PackedRunner

pytestmark = pytest.mark.gpu

# fp32 everywhere; the CPU kernel and the GPU loop sum experts in another order.
HYBRID_ATOL = 2e-4


def _logits(path, options: EngineConfig | None, prompts, steps):
    config = ModelConfig.from_hf(path)
    model = load_model(path, config, torch.device("cuda"), torch.float32, options)
    runner = PackedRunner(model, len(prompts), device="cuda")
    out = [runner.forward(dict(enumerate(prompts))).cpu()]
    for step in steps:
        out.append(runner.forward(step).cpu())
    return torch.cat(out)


@pytest.fixture(scope="module")
def case(tiny_dirs):
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (40, 9, 1)]
    steps = [{0: [3], 1: [4], 2: [5]}, {0: [6, 7, 8, 9, 10], 2: [11]}]
    path = tiny_dirs["embedded"]
    return path, prompts, steps, _logits(path, None, prompts, steps)


@pytest.mark.parametrize("num_gpu", [0, 3, 8])
def test_hybrid_matches_all_gpu(case, num_gpu):
    path, prompts, steps, want = case
    got = _logits(path, EngineConfig(kt_num_gpu_experts=num_gpu), prompts, steps)
    assert (got - want).abs().max().item() < HYBRID_ATOL


def test_hybrid_with_two_cpu_thread_pools(case):
    path, prompts, steps, want = case
    options = EngineConfig(kt_num_gpu_experts=3, kt_cpuinfer=2, kt_threadpool_count=2)
    got = _logits(path, options, prompts, steps)
    assert (got - want).abs().max().item() < HYBRID_ATOL


@pytest.mark.parametrize("num_gpu", [0, 3])
def test_layerwise_prefill_matches_regular_prefill(case, num_gpu):
    path, prompts, steps, want = case
    # Threshold 5: the 50-token prefill and the 6-token chunk go layerwise, decodes hybrid.
    options = EngineConfig(kt_num_gpu_experts=num_gpu, kt_gpu_prefill_token_threshold=5)
    got = _logits(path, options, prompts, steps)
    assert (got - want).abs().max().item() < HYBRID_ATOL


def test_frequency_placement_keeps_the_most_routed_experts(case):
    path, prompts, steps, want = case
    from glmflash.model.moe import Experts

    config = ModelConfig.from_hf(path)
    options = EngineConfig(kt_num_gpu_experts=3, kt_expert_placement="frequency")
    model = load_model(path, config, torch.device("cuda"), torch.float32, options,
                       warmup_ids=list(range(100, 400)))
    # HybridExperts is no module: reach it through each layer's Experts.backend.
    layers = [m.backend for m in model.modules() if isinstance(m, Experts)]
    resident = [sorted(torch.nonzero(b.local >= 0).flatten().tolist()) for b in layers]
    assert resident and all(len(r) == 3 for r in resident)
    assert any(r != [0, 1, 2] for r in resident)
    runner = PackedRunner(model, len(prompts), device="cuda")
    got = torch.cat([runner.forward(dict(enumerate(prompts))).cpu()] +
                    [runner.forward(step).cpu() for step in steps])
    assert (got - want).abs().max().item() < HYBRID_ATOL
