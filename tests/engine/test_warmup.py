"""The start-up warm-up runs every kernel family once (fresh prefill, prefix prefill beside a
decode, decodes; a long chunk and the layerwise path on a GPU), leaves the cache as it found it
and changes no output; the CPU expert kernels say whether they compile or load from cache."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine import warmup
from glmflash.engine.options import EngineConfig

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    """The same checkpoint with and without the warm-up (forwards of each recorded)."""
    calls: dict[str, list] = {"warm": [], "cold": []}
    original = warmup._run

    def recording(engine, batch):
        calls["warm"].append(([s.num_computed_tokens for s in batch.seqs], list(batch.num_tokens)))
        original(engine, batch)
    warmup._run = recording
    try:
        warm = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=256)
        cold = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=256,
                      skip_kernel_warmup=True)
    finally:
        warmup._run = original
    yield warm, cold, calls["warm"]
    warm.shutdown()
    cold.shutdown()


def test_the_schedule_covers_each_kernel_family(engines):
    _, _, forwards = engines
    prefixes, chunks = zip(*forwards, strict=True)
    assert prefixes[0] == [0, 0] and chunks[0] == [warmup.FIRST_CHUNK, warmup.SMALL_PROMPTS[1]]
    # a chunk continuing a cached prefix, beside a decode
    assert prefixes[1] == [warmup.FIRST_CHUNK, warmup.SMALL_PROMPTS[1]] and chunks[1][1] == 1
    assert chunks[2:] == ([1, 1], [1])


def test_the_warm_up_leaves_no_trace(engines):
    warm, cold, _ = engines
    for engine in (warm, cold):
        engine.check_integrity()
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
        assert len(engine.cache.free_state_slots) == engine.cache.plan.num_state_slots
        # Every page the warm-up took reached the runner's page table with its own forward.
        assert not engine.cache.page_updates
    prompts = ["The first request", "and another one"]
    assert [r.token_ids for r in warm.generate(prompts, PARAMS)] == \
        [r.token_ids for r in cold.generate(prompts, PARAMS)]


def test_gpu_plans_add_a_long_chunk_and_the_layerwise_path():
    options = EngineConfig(chunked_prefill_size=512, kt_num_gpu_experts=4,
                           kt_gpu_prefill_token_threshold=1024)
    gpu = SimpleNamespace(device=torch.device("cuda"), options=options, max_seq_len=4096)
    assert warmup._long_prefill_len(gpu) == 1024
    cpu = SimpleNamespace(device=torch.device("cpu"), options=options, max_seq_len=4096)
    assert warmup._long_prefill_len(cpu) == 0
    short = SimpleNamespace(device=torch.device("cuda"), options=EngineConfig(), max_seq_len=300)
    assert warmup._long_prefill_len(short) == 299


def test_cpu_expert_kernels_report_the_numba_cache(engines, caplog):
    warm, _, _ = engines
    with caplog.at_level(logging.INFO, logger="glmflash.engine.warmup"):
        warmup.warm_up_cpu_experts(warm.runner.model)
    # This process compiled or loaded them already, so the cache index is there now.
    assert "loading the CPU expert kernels from Numba's cache in" in caplog.text
    assert "CPU expert kernels ready in" in caplog.text


def test_a_one_slot_engine_warms_one_sequence(tiny_dirs, caplog):
    with caplog.at_level(logging.INFO, logger="glmflash.engine.warmup"):
        engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=64,
                        max_running_requests=1, background_loop=False)
    assert "3 forwards (prefill, prefix prefill, decode x1)" in caplog.text
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
