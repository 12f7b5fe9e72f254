"""Hybrid CPU/GPU experts and layerwise prefill vs all experts on the GPU (tiny model)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.engine.experts import (
    ExpertPlacement,
    hybrid_layers,
    place_experts,
    take_expert_times,
)
from glmflash.engine.model_runner import load_model, move_all_but_experts
from glmflash.engine.options import EngineConfig
from glmflash.model.moe import MoE
from tests.conftest import PackedRunner, load_tiny

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


def test_frequency_placement_copies_experts_to_the_gpu_once(case, monkeypatch):
    from glmflash.engine import experts

    path = case[0]
    copied: list[int] = []
    resident = experts._resident

    def counting(module, ids, device):
        copied.append(len(ids))
        return resident(module, ids, device)

    monkeypatch.setattr(experts, "_resident", counting)
    options = EngineConfig(kt_num_gpu_experts=3, kt_expert_placement="frequency")
    model = load_model(path, ModelConfig.from_hf(path), torch.device("cuda"), torch.float32,
                       options, warmup_ids=list(range(100, 400)))
    num_layers = len(hybrid_layers(model))
    # The count runs with every expert on the CPU (nothing copied), then one placement.
    assert num_layers and copied == [0] * num_layers + [3] * num_layers


# One MoE layer alone, fp32: the numba kernel and the grouped GPU kernel differ only in the
# order of fp32 sums.
LAYER_RTOL = 1e-5


def _moe_layers(path, num_gpu: int) -> tuple[MoE, MoE]:
    """The first MoE layer of the tiny model: all on the GPU, and hybrid with num_gpu resident."""
    def first(model) -> MoE:
        return next(m for m in model.modules() if isinstance(m, MoE))
    device = torch.device("cuda")
    all_gpu = first(load_tiny(path)).to(device)
    hybrid = first(load_tiny(path))
    move_all_but_experts(hybrid, device)
    place_experts(hybrid, ExpertPlacement(num_gpu), device)
    return all_gpu, hybrid


@contextmanager
def no_host_sync():
    """Any CUDA call that makes the host wait for the device raises inside this block."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@pytest.mark.parametrize("num_tokens", [1, 4])
@pytest.mark.parametrize("num_gpu", [0, 3, 8])
def test_decode_moe_layer_makes_no_host_sync(tiny_dirs, num_gpu, num_tokens):
    all_gpu, hybrid = _moe_layers(tiny_dirs["embedded"], num_gpu)
    gen = torch.Generator().manual_seed(42)
    xs = [torch.randn(num_tokens, all_gpu.gate.weight.shape[1], generator=gen).cuda()
          for _ in range(3)]
    # compile the kernels, build the CPU kernel, pin the staging buffers
    all_gpu(xs[0])
    hybrid(xs[0])
    with no_host_sync():
        want = [all_gpu(x) for x in xs]
        # several calls in a row reuse the pinned buffers while earlier copies may be in flight
        got = [hybrid(x) for x in xs]
    for g, w in zip(got, want, strict=True):
        assert (g - w).abs().max().item() <= LAYER_RTOL * w.abs().max().item()


def test_hybrid_times_show_cpu_and_gpu(tiny_dirs):
    _, hybrid = _moe_layers(tiny_dirs["embedded"], 3)
    x = torch.randn(2, hybrid.gate.weight.shape[1], device="cuda")
    hybrid(x)
    take_expert_times(hybrid)
    for layer in hybrid_layers(hybrid):
        layer.record_gpu_times = True
    for _ in range(3):
        hybrid(x)
    times = take_expert_times(hybrid)
    assert times.num_calls == 3
    assert times.cpu_s > 0 and times.gpu_s > 0 and times.wait_s >= 0
    assert take_expert_times(hybrid).num_calls == 0
