"""The engine against the oracle: concurrent arrivals, chunked prefill, preemption, aborts."""

from __future__ import annotations

import asyncio

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.outputs import ResultCollector, StreamDelta
from tests.oracle import assert_greedy_matches

# 10 pages of 8 tokens with 4 state slots: nine requests of 5..40 prompt tokens plus 10 outputs
# cannot all fit, so the scheduler must preempt and recompute.
SMALL_CACHE = dict(context_length=64, page_size=8, chunked_prefill_size=7,
                   max_running_requests=4, background_loop=False, check_integrity=True)


def _budget_gb(engine_cls_kwargs, pages: int, tiny_dir) -> float:
    import json

    from glmflash.config import ModelConfig
    from glmflash.engine.options import EngineConfig
    from glmflash.model.state import cache_bytes

    config = ModelConfig.from_dict(json.loads((tiny_dir / "config.json").read_text()))
    per_token, per_slot = cache_bytes(config, torch.float32)
    options = EngineConfig(**engine_cls_kwargs)
    # State slots plus the prefix cache's snapshots, each as large as a slot.
    slots = options.max_running_requests + options.num_state_snapshots
    return (slots * per_slot + pages * engine_cls_kwargs["page_size"] * per_token) / 2**30


@pytest.fixture(scope="module")
def small_engine(tiny_dirs):
    budget = _budget_gb(SMALL_CACHE, 10, tiny_dirs["embedded"])
    return Engine(tiny_dirs["embedded"], device="cpu", dtype="float32",
                  cache_budget_gb=budget, **SMALL_CACHE)


def _submit(engine, prompt, params, collectors):
    collector = ResultCollector("", prompt, 1)
    collector.request_id = engine.add_request(prompt, params, collector.add)
    collectors.append(collector)
    return collector


def test_concurrent_arrivals_match_oracle_with_preemption(small_engine, oracles):
    engine = small_engine
    assert engine.cache.plan.num_pages == 10
    g = torch.Generator().manual_seed(21)
    lengths = [5, 40, 17, 9, 33, 12, 26, 3, 21]
    arrivals = [0, 0, 1, 3, 3, 5, 8, 9, 12]
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    collectors, step = [], 0
    preemptions_before = engine.scheduler.num_preemptions
    while step <= max(arrivals) or not all(c.is_done for c in collectors):
        for prompt, at in zip(prompts, arrivals, strict=True):
            if at == step:
                _submit(engine, prompt, params, collectors)
        engine.step()
        step += 1
        assert step < 500
    assert engine.scheduler.num_preemptions > preemptions_before
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    for prompt, collector in zip(prompts, collectors, strict=True):
        result = collector.result()
        assert result.finish_reason == "length" and len(result.token_ids) == 10
        assert_greedy_matches(oracles["embedded"], prompt, result.token_ids)


@pytest.mark.parametrize("steps_before_abort", [1, 9], ids=["mid_prefill", "mid_decode"])
def test_abort_frees_pages_and_slots(small_engine, steps_before_abort):
    engine = small_engine
    deltas: list[StreamDelta] = []
    rid = engine.add_request(list(range(1, 30)), SamplingParams(max_tokens=20, ignore_eos=True),
                             deltas.append)
    for _ in range(steps_before_abort):
        engine.step()
    produced = sum(len(d.token_ids) for d in deltas)
    assert (produced == 0) == (steps_before_abort == 1)
    engine.abort(rid)
    engine.step()
    assert deltas[-1].finish_reason == "abort"
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert len(engine.cache.free_state_slots) == engine.cache.plan.num_state_slots
    engine.check_integrity()


def test_streaming_deltas_concatenate_to_the_result(small_engine):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    streamed = list(small_engine.stream("stream me", params))
    (whole,) = small_engine.generate("stream me", params)
    assert "".join(d.text for d in streamed) == whole.text
    assert sum((d.token_ids for d in streamed), []) == whole.token_ids
    assert streamed[-1].finish_reason == "length" and streamed[-1].num_output_tokens == 10


def test_stop_string_never_leaks_partially(small_engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (base,) = small_engine.generate("leak", params)
    text = base.text
    stop = next(text[i:i + 3] for i in range(2, len(text) - 3) if text[i:i + 3].strip())
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    streamed = list(small_engine.stream("leak", params))
    # Emission is append-only, so equality means no character of the stop string ever left.
    joined = "".join(d.text for d in streamed)
    assert joined == text[: text.index(stop)]
    assert streamed[-1].finish_reason == "stop"


def test_n_choices_and_seeds(small_engine):
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=7, ignore_eos=True)
    (result,) = small_engine.generate("many", params, n=3)
    assert len(result.choices) == 3
    (again,) = small_engine.generate("many", params, n=3)
    assert [c.token_ids for c in result.choices] == [c.token_ids for c in again.choices]
    assert len({tuple(c.token_ids) for c in result.choices}) > 1


def test_async_stream_with_background_thread(tiny_dirs):
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=128)

    async def main():
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        parts = [d async for d in engine.astream("async", params)]
        result = await engine.agenerate("async", params)
        return parts, result

    try:
        parts, result = asyncio.run(main())
        assert "".join(p.text for p in parts) == result.text and len(result.token_ids) == 4
        deltas = engine.stream("abandon", SamplingParams(max_tokens=50, ignore_eos=True))
        next(deltas)
        deltas.close()  # leaving the stream aborts the request
        import time

        for _ in range(100):
            if not engine.scheduler.has_work:
                break
            time.sleep(0.05)
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    finally:
        engine.shutdown()


def test_a_failing_step_ends_its_requests_not_the_engine(tiny_dirs):
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=128)

    def explode(_output_ids, _logits):
        raise RuntimeError("boom")

    try:
        with pytest.raises(RuntimeError, match="boom"):
            engine.generate("x", SamplingParams(max_tokens=3, logits_processors=[explode]))
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
        (ok,) = engine.generate("x", SamplingParams(max_tokens=3, temperature=0))
        assert len(ok.token_ids) >= 1
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs,message", [
    (dict(device="tpu"), "unknown device"),
    (dict(dtype=torch.int8), "unsupported dtype"),
    (dict(dtype="fp64"), "unknown dtype"),
])
def test_engine_refuses_a_device_or_dtype_with_a_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Engine(None, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_engine_on_cuda_without_a_gpu_is_a_value_error():
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        Engine(None, device="cuda")


def test_a_context_past_the_models_positions_is_warned(caplog):
    """The model has no rotary positions, so a longer context runs; it is past what the
    checkpoint says it was trained for, which the log says."""
    engine = Engine(None, device="cpu", dtype="float32", context_length=2**20 + 64,
                    background_loop=False, skip_kernel_warmup=True)
    engine.shutdown()
    assert "past the model's max_position_embeddings 1048576" in caplog.text
