"""A failed step ends only the requests it ran; a dead engine thread is reported, never a hang."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from glmflash import Engine, SamplingParams
from glmflash.engine.engine import EngineDead
from glmflash.engine.graph_handoff import CpuExpertsFailed
from glmflash.engine.outputs import ResultCollector
from glmflash.sampling_params import MAX_SEED, MIN_SEED

MARKER = 999


def _submit(engine: Engine, prompt: list[int], params: SamplingParams) -> ResultCollector:
    collector = ResultCollector("", prompt, 1)
    collector.request_id = engine.add_request(prompt, params, collector.add)
    return collector


@pytest.fixture
def stepped(tiny_dirs):
    """An engine driven by the test (one running request at a time), integrity checked."""
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=128,
                    max_running_requests=1, background_loop=False, check_integrity=True)
    yield engine
    engine.shutdown()


def _failing_forward(engine: Engine, *, times: int):
    """Make the forward pass raise for batches holding the MARKER token, `times` times."""
    run, left = engine.runner.run, [times]

    def run_or_fail(batch):
        if left[0] and any(MARKER in s.token_ids for s in batch.seqs):
            left[0] -= 1
            raise RuntimeError("forward exploded")
        return run(batch)
    engine.runner.run = run_or_fail


def test_a_forward_error_ends_the_step_requests_only(stepped):
    engine = stepped
    _failing_forward(engine, times=1)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    bad = _submit(engine, [1, 2, MARKER], params)
    good = _submit(engine, [4, 5, 6], params)
    for _ in range(50):
        engine._guarded_step()
        if bad.is_done and good.is_done:
            break
    assert bad.choices[0].finish_reason == "error" and "forward exploded" in bad.error
    assert good.choices[0].finish_reason == "length" and len(good.choices[0].token_ids) == 4
    engine.check_integrity()
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert engine.num_pending == 0 and engine.failure is None


def test_extreme_seeds_sample_every_choice(stepped):
    for seed in (MAX_SEED, MIN_SEED):
        params = SamplingParams(max_tokens=3, temperature=1.0, seed=seed, ignore_eos=True)
        (result,) = stepped.generate(prompt_token_ids=[[3, 4]], sampling_params=params, n=3)
        assert [c.finish_reason for c in result.choices] == ["length"] * 3


@pytest.mark.parametrize("kwargs", [dict(seed=2**64), dict(seed=MIN_SEED - 1),
                                    dict(temperature=float("nan")), dict(top_p=float("nan")),
                                    dict(min_p=float("nan")), dict(presence_penalty=float("inf")),
                                    dict(repetition_penalty=float("nan"))])
def test_sampling_params_refuse_values_no_sampler_takes(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def _run_to_end(engine: Engine, params: SamplingParams) -> ResultCollector:
    """Submit [1, 2] to an engine with its thread and wait until the request has ended."""
    done = threading.Event()
    collector = ResultCollector("", [1, 2], 1)

    def sink(delta):
        collector.add(delta)
        if collector.is_done:
            done.set()
    engine.add_request([1, 2], params, sink)
    assert done.wait(30), "the request was never ended"
    return collector


@pytest.mark.parametrize("fatal", [SystemExit("killed"),
                                   RuntimeError("CUDA error: an illegal memory access")])
def test_a_dead_engine_thread_fails_its_requests_and_refuses_more(tiny_dirs, fatal):
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=128)
    try:
        def die(batch):
            raise fatal
        engine.runner.run = die
        collector = _run_to_end(engine, SamplingParams(max_tokens=3))
        assert collector.choices[0].finish_reason == "error"
        assert "engine stopped" in collector.error
        assert engine.failure is not None and type(fatal).__name__ in engine.failure
        with pytest.raises(EngineDead):
            engine.add_request([1, 2], SamplingParams(max_tokens=3), lambda d: None)
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    finally:
        engine.shutdown()


class _FailingHandOff:
    """The graph hand-off's failure report (engine/graph_handoff.py) without the GPU: the
    serving loop's failure flag, set by the test while a step runs."""

    def __init__(self) -> None:
        self.failed = False

    def check(self) -> None:
        if self.failed:
            raise CpuExpertsFailed("CPU experts of the captured decode failed: test")


def test_cpu_experts_failing_during_a_step_end_the_engine_before_its_tokens(tiny_dirs):
    """The CPU experts' serving loop fails while a step's graphs replay: the check once the
    host has read the step's tokens raises, so none of them reaches the request, and the
    engine stops (every later replay would run without the experts)."""
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=128)
    try:
        handoff = _FailingHandOff()
        engine.runner.graphs = SimpleNamespace(handoff=handoff, can_replay=lambda n: False,
                                               close=lambda: None)
        run, steps = engine.runner.run, [0]

        def run_then_fail(batch):
            steps[0] += 1
            if steps[0] == 2:  # the step's replay returns, the loop has failed meanwhile
                handoff.failed = True
            return run(batch)
        engine.runner.run = run_then_fail
        collector = _run_to_end(engine, SamplingParams(max_tokens=5, temperature=0,
                                                       ignore_eos=True))
        assert collector.choices[0].finish_reason == "error"
        assert len(collector.choices[0].token_ids) == 1  # the first step's token only
        assert engine.failure is not None and "CpuExpertsFailed" in engine.failure
        assert steps[0] == 2
    finally:
        engine.shutdown()
