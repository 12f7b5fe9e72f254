"""Failure isolation in the library: one bad request (a logits processor returning a bad
row, sampling values of the wrong type, a consumer that raises or whose event loop closed, a
failed step in a caller-driven engine, n below one) beside a good one: the good one is
untouched (same tokens as alone) and the engine lives; a failed step leaves no prefix-cache
snapshot it never saved."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.errors import EngineOverloaded
from glmflash.engine.outputs import ResultCollector

GOOD_PROMPT, BAD_PROMPT = [4, 5, 6], [1, 2, 3]
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def stepped():
    engine = Engine(None, device="cpu", dtype="float32", context_length=128,
                    background_loop=False, check_integrity=True, max_running_requests=4)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(stepped):
    (alone,) = stepped.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=GREEDY)
    return alone.token_ids


def _submit(engine, prompt, params):
    collector = ResultCollector("", prompt, 1)
    collector.request_id = engine.add_request(prompt, params, collector.add)
    return collector


def _bad_beside_good(engine, bad_params):
    bad, good = _submit(engine, BAD_PROMPT, bad_params), _submit(engine, GOOD_PROMPT, GREEDY)
    for _ in range(100):
        engine._guarded_step()  # what the engine thread runs
        if bad.is_done and good.is_done:
            break
    return bad, good


@pytest.mark.parametrize("processor", [
    lambda ids, row: row[:-1],              # wrong shape
    lambda ids, row: torch.cat([row, row]),  # wrong shape
    lambda ids, row: None,                  # forgot to return
    lambda ids, row: [0.0, 1.0],            # a Python list
    lambda ids, row: row.to("meta"),        # another device
], ids=["short", "long", "none", "list", "meta"])
def test_a_processor_returning_a_bad_row_fails_only_its_request(stepped, reference, processor):
    bad_params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True,
                                logits_processors=[processor])
    bad, good = _bad_beside_good(stepped, bad_params)
    assert bad.choices[0].finish_reason == "error"
    assert good.error is None, f"the good request was failed too: {good.error}"
    assert good.choices[0].token_ids == reference


@pytest.mark.parametrize("kwargs", [
    dict(temperature=1.0, seed=1.5),
    dict(temperature=1.0, top_k=2**70),
    dict(logprobs=2.5),
    dict(logprobs=True),
    dict(prompt_logprobs=2.5),
    dict(skip_special_tokens=None),
    dict(skip_special_tokens=0),
    dict(skip_special_tokens="false"),
    dict(stop_token_ids=[1.5]),
], ids=["float-seed", "huge-top_k", "float-logprobs", "bool-logprobs", "float-prompt_logprobs",
        "none-skip_special", "int-skip_special", "str-skip_special", "float-stop_token_id"])
def test_bad_sampling_param_types_fail_only_their_request(stepped, reference, kwargs):
    try:
        bad_params = SamplingParams(max_tokens=4, ignore_eos=True, **kwargs)
    except (ValueError, TypeError):
        return  # refused up front: fine
    bad, good = _bad_beside_good(stepped, bad_params)
    assert good.error is None, f"the good request was failed too: {good.error}"
    assert good.choices[0].token_ids == reference


def test_a_raising_sink_ends_only_its_request():
    engine = Engine(None, device="cpu", dtype="float32", context_length=128)
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        good, done = ResultCollector("", GOOD_PROMPT, 1), threading.Event()

        def good_sink(delta):
            good.add(delta)
            if good.is_done:
                done.set()

        def bad_sink(delta):
            raise RuntimeError("consumer went away")

        engine.add_request(BAD_PROMPT, params, bad_sink)
        engine.add_request(GOOD_PROMPT, params, good_sink)
        assert done.wait(30)
        assert engine.failure is None, f"engine died: {engine.failure}"
        assert good.error is None and len(good.choices[0].token_ids) == 20
    finally:
        engine.shutdown()


def test_an_astream_whose_loop_closed_does_not_kill_the_engine():
    engine = Engine(None, device="cpu", dtype="float32", context_length=512)

    def slow(ids, row):  # a step long enough for the consumer's loop to close inside it
        time.sleep(0.05)
        return row

    params = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                            logits_processors=[slow])

    async def take_one():
        async for delta in engine.astream(prompt_token_ids=[1, 2, 3], sampling_params=params):
            return delta  # the loop's shutdown_asyncgens closes the generator (it aborts)

    try:
        for _ in range(3):
            asyncio.run(take_one())
            time.sleep(0.3)
            assert engine.failure is None, f"engine died: {engine.failure}"
    finally:
        engine.shutdown()


MARKER = 999  # a forward fails on batches holding it


def test_a_failing_request_does_not_wedge_a_caller_driven_engine():
    engine = Engine(None, device="cpu", dtype="float32", context_length=128,
                    background_loop=False, check_integrity=True)
    try:
        (reference,) = engine.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=GREEDY)
        run = engine.runner.run

        def run_or_fail(batch):
            if any(MARKER in s.token_ids for s in batch.seqs):
                raise RuntimeError("forward exploded")
            return run(batch)
        engine.runner.run = run_or_fail
        with pytest.raises(RuntimeError, match="forward exploded"):
            engine.generate(prompt_token_ids=[[1, 2, MARKER]], sampling_params=GREEDY)
        (after,) = engine.generate(prompt_token_ids=[GOOD_PROMPT], sampling_params=GREEDY)
        assert after.token_ids == reference.token_ids
        assert engine.num_pending == 0
    finally:
        engine.shutdown()


def test_an_undeliverable_abort_fails_only_the_aborted_request():
    engine = Engine(None, device="cpu", dtype="float32", context_length=512)
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        good, done = ResultCollector("", GOOD_PROMPT, 1), threading.Event()
        started = threading.Event()

        def good_sink(delta):
            good.add(delta)
            if good.is_done:
                done.set()

        def bad_sink(delta):
            started.set()
            if delta.finish_reason == "abort":
                raise RuntimeError("Event loop is closed")

        rid = engine.add_request(BAD_PROMPT, params, bad_sink)
        engine.add_request(GOOD_PROMPT, params, good_sink)
        assert started.wait(30)
        engine.abort(rid)
        assert done.wait(60)
        assert good.error is None, f"the good request was failed too: {good.error}"
        assert good.choices[0].finish_reason == "length"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kwargs", [dict(skip_special_tokens=None), dict(ignore_eos=1),
                                    dict(temperature=True), dict(top_p="0.5"),
                                    dict(stop_token_ids=[2, "3"])])
def test_sampling_params_refuse_wrong_types(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_generate_of_no_prompts_returns_at_once(stepped):
    assert stepped.generate(prompt_token_ids=[], sampling_params=GREEDY) == []
    assert stepped.generate([], GREEDY) == []


def test_a_refused_generate_leaves_none_of_its_prompts_running():
    """The third prompt is refused (the queue holds two): the two added before it are
    withdrawn, so they neither hold the queue nor run for nobody."""
    engine = Engine(None, device="cpu", dtype="float32", context_length=128,
                    background_loop=False, max_queued_requests=2)
    try:
        with pytest.raises(EngineOverloaded):
            engine.generate(prompt_token_ids=[GOOD_PROMPT, BAD_PROMPT, [7, 8, 9]],
                            sampling_params=GREEDY)
        engine.step()
        assert engine.num_pending == 0 and not engine.scheduler.has_work
        assert len(engine.generate(prompt_token_ids=[GOOD_PROMPT, BAD_PROMPT],
                                   sampling_params=GREEDY)) == 2
    finally:
        engine.shutdown()


def test_the_queue_limit_counts_choices():
    """max_queued_requests bounds choices in flight: a request of more choices than are left
    is refused whole, one that fits is taken."""
    engine = Engine(None, device="cpu", dtype="float32", context_length=128,
                    background_loop=False, max_queued_requests=3)
    try:
        engine.add_request(GOOD_PROMPT, GREEDY, lambda d: None, n=2)
        with pytest.raises(EngineOverloaded):
            engine.add_request(BAD_PROMPT, GREEDY, lambda d: None, n=2)
        assert engine.num_pending == 2
        engine.add_request(BAD_PROMPT, GREEDY, lambda d: None)
        assert engine.num_pending == 3
    finally:
        engine.shutdown()


def test_a_request_id_in_use_is_refused(stepped):
    """An abort ends every choice of its id: a second request of an unfinished one's id would
    let either caller end the other's. Free again once the first has finished."""
    first = ResultCollector("", GOOD_PROMPT, 1)
    stepped.add_request(GOOD_PROMPT, GREEDY, first.add, request_id="job")
    with pytest.raises(ValueError, match="in use"):
        stepped.add_request(BAD_PROMPT, GREEDY, lambda d: None, request_id="job")
    while not first.is_done:
        stepped._guarded_step()
    assert first.choices[0].finish_reason == "length"
    again = ResultCollector("", GOOD_PROMPT, 1)
    assert stepped.add_request(GOOD_PROMPT, GREEDY, again.add, request_id="job") == "job"
    while not again.is_done:
        stepped._guarded_step()
    assert stepped.num_pending == 0


def test_a_step_failing_before_its_batch_does_not_bring_back_inbox_requests(stepped):
    """The failure ends every live choice, also one whose request another thread added after
    the step drained the inbox: that request must not be admitted afterwards (it ran with no
    choice to deliver to, failing every batch it was in)."""
    late = ResultCollector("", BAD_PROMPT, 1)
    schedule = stepped.scheduler.schedule

    def add_then_fail():
        stepped.scheduler.schedule = schedule
        late.request_id = stepped.add_request(BAD_PROMPT, GREEDY, late.add)
        raise RuntimeError("schedule exploded")
    stepped.scheduler.schedule = add_then_fail
    stepped._guarded_step()
    assert late.choices[0].finish_reason == "error"
    good = _submit(stepped, GOOD_PROMPT, GREEDY)
    while not good.is_done:
        stepped._guarded_step()
    assert good.error is None and good.choices[0].finish_reason == "length"
    assert not stepped.scheduler.has_work
    stepped.check_integrity()
    assert stepped.cache.num_free_pages == stepped.cache.plan.num_pages


def test_add_request_refuses_n_below_one():
    engine = Engine(None, device="cpu", dtype="float32", context_length=128,
                    background_loop=False, max_queued_requests=1)
    try:
        with pytest.raises(ValueError):
            engine.add_request([1, 2], SamplingParams(max_tokens=2), lambda d: None, n=-3)
    finally:
        assert engine.num_pending >= 0, f"num_pending is {engine.num_pending}"
        engine.shutdown()


def test_a_failed_step_leaves_no_stale_prefix_snapshot_for_later_requests():
    prefix = [(i * 37 + 11) % 1000 + 1 for i in range(70)]
    later = prefix + [7, 8]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def make():
        return Engine(None, device="cpu", dtype="float32", context_length=256,
                      background_loop=False, check_integrity=True)

    def run(engine, prompt):
        collector = _submit(engine, prompt, params)
        while not collector.is_done:
            engine._guarded_step()
        return collector

    reference_engine = make()
    try:
        expected = run(reference_engine, later).choices[0].token_ids
    finally:
        reference_engine.shutdown()
    engine = make()
    try:
        real, calls = engine.runner.run, [0]

        def run_or_fail(batch):
            calls[0] += 1
            if calls[0] == 2:  # the decode step right after the prefix's prefill
                raise RuntimeError("injected step failure")
            return real(batch)
        engine.runner.run = run_or_fail
        assert run(engine, prefix).choices[0].finish_reason == "error"
        got = run(engine, later)
        assert got.choices[0].token_ids == expected, \
            f"a later request read a stale prefix snapshot: {got.choices[0].token_ids} " \
            f"!= {expected}"
    finally:
        engine.shutdown()
