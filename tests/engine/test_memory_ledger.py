"""The start-up memory ledger: release figures at 1M tokens, the refusal and its flags (CPU and,
with a GPU's memory given, the GPU rules), the cap that keeps workspaces free, and the
workspace estimate against what the CPU forward really allocates."""

from __future__ import annotations

import gc

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.engine.memory_ledger import GIB, MIB, MemoryPlanError
from glmflash.engine.memory_plan import DeviceMemory, plan_memory
from glmflash.engine.options import EngineConfig
from glmflash.engine.workspace import forward_bytes
from tests.buffer_tracker import BufferTracker
from tests.conftest import PackedRunner, load_tiny
from tools.memory_ledger import RELEASE_CONFIG, release_ledger

ONE_M = 1 << 20
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def release() -> ModelConfig:
    return ModelConfig.from_hf(RELEASE_CONFIG)


def test_release_cache_at_1m_tokens():
    """11 MLA layers x (512 bf16 latent + 128 bf16 pooled key / 4) = 11,968 B/token: 11.69 GiB
    for one 1M sequence. Per slot: 34 KDA layers x (64 x 128 x 128 fp32 state + 3 x 8192 x 3
    bf16 conv history) and 11 indexer tails of 3 x 256 bf16."""
    options = EngineConfig(context_length=ONE_M, max_running_requests=1,
                           chunked_prefill_size=8192, kt_num_gpu_experts=0)
    ledger = release_ledger(options, gpu_gib=139.8)
    pages = ledger.row("MLA pages")
    assert "11968 B/token" in pages.note and "1048576 tokens" in pages.note
    assert pages.nbytes / GIB == pytest.approx(11.69, abs=0.01)
    per_slot = 34 * (64 * 128 * 128 * 4 + 3 * 8192 * 3 * 2) + 11 * 3 * 256 * 2
    assert ledger.row("KDA state slots").nbytes == 2 * per_slot
    assert ledger.left > 0 and "left" in ledger.table()


def test_release_refuses_what_does_not_fit():
    """All experts on one H200 leave no room for a 1M cache: refused with the ledger."""
    options = EngineConfig(context_length=ONE_M, max_running_requests=1)
    with pytest.raises(MemoryPlanError) as info:
        release_ledger(options, gpu_gib=139.8)
    text = str(info.value)
    assert "exceeds the device" in text or "cannot start: one sequence" in text
    assert "memory ledger on cuda" in text and "--kt-num-gpu-experts" in text


def _gpu_plan(config, gpu_gib: float, weights_gib: float, **options):
    total, weights = int(gpu_gib * GIB), int(weights_gib * GIB)
    memory = DeviceMemory(total=total, free=total - weights - 512 * MIB, allocated=weights,
                          reserved=weights)
    return plan_memory(config, EngineConfig(**options), options["context_length"], CUDA,
                       torch.bfloat16, graph_sizes=[1, 2], memory=memory)


def test_gpu_refusal_names_the_context_that_fits(release):
    with pytest.raises(MemoryPlanError) as info:
        _gpu_plan(release, 80, 60, context_length=ONE_M, max_running_requests=2,
                  chunked_prefill_size=4096, mem_fraction_static=0.9)
    text = str(info.value)
    fits = int(text.split("--context-length ")[1].split()[0])
    assert 0 < fits < ONE_M
    # What it names does fit.
    plan, _ = _gpu_plan(release, 80, 60, context_length=fits, max_running_requests=2,
                        chunked_prefill_size=4096, mem_fraction_static=0.9)
    assert plan.max_pages_per_seq <= plan.num_pages


def test_gpu_cache_is_capped_so_workspaces_fit(release, caplog):
    """A fraction that would leave no room for the workspaces gives a smaller cache."""
    plan, ledger = _gpu_plan(release, 80, 20, context_length=131072, max_running_requests=64,
                             chunked_prefill_size=8192, mem_fraction_static=1.0)
    assert "capped" in caplog.text
    assert 0 <= ledger.left < ledger.row("MLA pages").nbytes
    assert plan.num_pages < 64 * plan.max_pages_per_seq


def test_cpu_refusal_names_the_budget_flag(tiny_dirs):
    config = ModelConfig.from_hf(tiny_dirs["embedded"])
    options = EngineConfig(context_length=ONE_M, cache_budget_gb=0.05)
    with pytest.raises(MemoryPlanError) as info:
        plan_memory(config, options, ONE_M, torch.device("cpu"), torch.float32)
    text = str(info.value)
    assert "--cache-budget-gb" in text and "--context-length" in text and "MLA pages" in text
    fits = int(text.split("--context-length ")[1].split()[0])
    plan, _ = plan_memory(config, EngineConfig(context_length=fits, cache_budget_gb=0.05), fits,
                          torch.device("cpu"), torch.float32)
    assert plan.num_pages >= plan.max_pages_per_seq


def test_workspace_estimate_bounds_the_cpu_forward(tiny_dirs):
    """The estimate covers what a 512-token chunk allocates at its peak (measured 3.0x below it
    on the reference kernels)."""
    model = load_tiny(tiny_dirs["embedded"])
    runner = PackedRunner(model, 1, max_len=2048)
    runner.done[0] = 1024
    gc.collect()
    with BufferTracker() as tracker:
        runner.forward({0: [(7 * i) % 1000 for i in range(512)]}, all_logits=True)
    estimate = forward_bytes(model.config, 512, 512, 1536 // 4, 4, reference=True)
    assert tracker.peak_bytes <= estimate <= 4 * tracker.peak_bytes


def test_engine_refuses_to_start_with_the_ledger(tiny_dirs):
    from glmflash import Engine

    with pytest.raises(MemoryPlanError, match="--cache-budget-gb"):
        Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=ONE_M,
               cache_budget_gb=0.01, background_loop=False)


def test_expected_reserved_takes_measured_rows_and_leaves_out_what_torch_does_not_hold():
    from glmflash.engine.memory_ledger import GPU, MemoryLedger

    ledger = MemoryLedger("cuda:0", 100 * GIB)
    ledger.add("weights and buffers", GPU, 30 * GIB, "measured")
    ledger.add("CUDA context, other processes", GPU, GIB, "measured")
    ledger.add("activations and workspaces", GPU, 5 * GIB, "estimated")
    ledger.add("prompt-logprob logits", GPU, 12 * GIB, "estimated")
    ledger.add("CUDA graphs", GPU, MIB, "estimated")
    ledger.add("margin", GPU, GIB // 2, "planned")
    ledger.add("MLA pages", GPU, 2 * GIB, "planned")
    assert ledger.expected_reserved() == 37 * GIB + MIB
    ledger.record("activations and workspaces", 3 * GIB)
    ledger.record("CUDA graphs", 200 * MIB)
    assert ledger.expected_reserved() == 35 * GIB + 200 * MIB
    # The plan keeps the larger of estimate and measurement.
    assert ledger.used() == 30 * GIB + GIB + 5 * GIB + 12 * GIB + 200 * MIB + GIB // 2 + 2 * GIB
    assert ledger.expected_reserved(as_planned=True) == 37 * GIB + 200 * MIB
