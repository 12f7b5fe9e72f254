"""Speculative decoding with the trained tiny model's MTP layer against the same engine without
drafts: greedy tokens over concurrent arrivals, chunked prefill and preemption; seeded sampling;
stop strings inside an accepted run; logprobs; aborts; the prefix cache."""

from __future__ import annotations

import pytest

from glmflash import Engine, SamplingParams
from tests.engine.spec_helpers import SPEC, TEXTS, TRAINED, run_arrivals, spec_engine


@pytest.fixture(scope="module")
def engines():
    # Drafting stays on whatever its measured speed (the CPU check would hold it off after the
    # first tests, and the later ones would compare MTP off with MTP off).
    return {"off": spec_engine(), "on": spec_engine(**SPEC, disable_speculative_speed_check=True)}


def test_greedy_tokens_equal_mtp_off_with_chunks_and_preemption(engines):
    prompts = [engines["off"].tokenizer.encode(t) for t in TEXTS[:4]]
    arrivals = [0, 0, 1, 3]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs = {}
    for name, engine in engines.items():
        preempted = engine.scheduler.num_preemptions
        results = [c.result() for c in run_arrivals(engine, prompts, arrivals, params)]
        assert engine.scheduler.num_preemptions > preempted, name
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
        outputs[name] = [r.token_ids for r in results]
    assert outputs["on"] == outputs["off"]
    stats = engines["on"].stats().speculative
    # Drafts were made and used (the measured agreement of this MTP layer is about 0.8).
    assert stats.num_draft_tokens > 10 and stats.acceptance_rate > 0.3
    assert stats.mean_accepted_length > 1.3
    assert results[0].mean_accepted_length > 1.0 and results[0].choices[0].num_draft_tokens


def test_seeded_sampling_draws_the_tokens_of_mtp_off(engines):
    """Sampling on the trained tiny model: each seed draws with MTP on the tokens it draws
    without it (every verified row takes the noise a plain step would take there), so the
    outputs' distribution over seeds is the same, a stronger statement than a statistical test
    of it; tests/engine/test_spec_sampling.py tests the rejection rule's distribution
    statistically on its own."""
    prompt = engines["off"].tokenizer.encode(TEXTS[0])
    drafted = engines["on"].stats().speculative.num_draft_tokens
    outputs = {}
    for name, engine in engines.items():
        # Temperature 1.5: at 0.8 the trained model tells this story the same way every time.
        params = [SamplingParams(max_tokens=8, temperature=1.5, seed=s, ignore_eos=True)
                  for s in range(4)]
        outputs[name] = [r.token_ids for r in engine.generate(
            prompt_token_ids=[prompt] * len(params), sampling_params=params)]
    assert outputs["on"] == outputs["off"]
    assert len({tuple(o) for o in outputs["on"]}) > 1
    assert engines["on"].stats().speculative.num_draft_tokens - drafted >= 8


def test_stop_string_inside_an_accepted_run_cuts_tokens_and_logprobs(engines):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    (base,) = engines["off"].generate(TEXTS[1], params)
    text = base.text
    stop = next(text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].strip())
    results = {}
    for name, engine in engines.items():
        stopped = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2,
                                 stop=[stop])
        deltas = list(engine.stream(TEXTS[1], stopped))
        (result,) = engine.generate(TEXTS[1], stopped)
        assert "".join(d.text for d in deltas) == result.text == text[: text.index(stop)]
        assert deltas[-1].finish_reason == "stop"
        assert len(result.logprobs) == len(result.token_ids) == deltas[-1].num_output_tokens
        results[name] = result
    assert results["on"].token_ids == results["off"].token_ids
    for on, off in zip(results["on"].logprobs, results["off"].logprobs, strict=True):
        assert on.keys() == off.keys()
        assert all(abs(on[t] - off[t]) < 1e-4 for t in on)


def test_max_tokens_is_never_passed_by_a_run(engines):
    for max_tokens in (1, 2, 4):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        (on,) = engines["on"].generate(TEXTS[2], params)
        (off,) = engines["off"].generate(TEXTS[2], params)
        assert on.token_ids == off.token_ids and len(on.token_ids) == max_tokens


@pytest.mark.parametrize("steps_before_abort", [2, 7], ids=["mid_prefill", "mid_decode"])
def test_abort_with_drafts_frees_pages_and_slots(engines, steps_before_abort):
    engine = engines["on"]
    deltas = []
    rid = engine.add_request(engine.tokenizer.encode(TEXTS[3]),
                             SamplingParams(max_tokens=30, ignore_eos=True), deltas.append)
    for _ in range(steps_before_abort):
        engine.step()
    engine.abort(rid)
    engine.step()
    assert deltas[-1].finish_reason == "abort"
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert len(engine.cache.free_state_slots) == engine.cache.plan.num_state_slots


def test_prefix_cache_hits_keep_the_tokens(engines):
    shared = Engine(TRAINED, device="cpu", dtype="float32", context_length=48, page_size=8,
                    chunked_prefill_size=8,
                    max_running_requests=2, background_loop=False, check_integrity=True,
                    skip_kernel_warmup=True, **SPEC)
    prefix = shared.tokenizer.encode("Once upon a time, a little fox lived in the woods. ")
    prompts = [prefix + shared.tokenizer.encode(t) for t in ("The fox", "One day it")]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    try:
        first = [r.token_ids for r in shared.generate(prompt_token_ids=prompts,
                                                      sampling_params=params)]
        again = shared.generate(prompt_token_ids=prompts, sampling_params=params)
        assert all(r.num_cached_tokens > 0 for r in again)
        assert [r.token_ids for r in again] == first
    finally:
        shared.shutdown()
    assert [r.token_ids for r in engines["off"].generate(prompt_token_ids=prompts,
                                                         sampling_params=params)] == first


def test_a_hit_where_the_next_token_differs_keeps_the_tokens(engines):
    """A prompt that extends a cached prompt with another token than the one the cached
    request sampled takes the hit (the MTP layer's row before it was computed from that other
    token: spec_drafts.py says why it is kept) and still gives the tokens of MTP off."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    cached = spec_engine(pages=16, disable_radix_cache=False, **SPEC,
                         disable_speculative_speed_check=True)
    tokenizer = cached.tokenizer
    prefix = tokenizer.encode("Once upon a time, a little fox lived in the woods. ")
    (first,) = cached.generate(prompt_token_ids=[prefix], sampling_params=params)
    tail = next(t for t in map(tokenizer.encode, ("Zebra", "Tom said", "1 2 3"))
                if t[0] != first.token_ids[0])
    (hit,) = cached.generate(prompt_token_ids=[prefix + tail], sampling_params=params)
    assert hit.num_cached_tokens == len(prefix)
    assert cached.stats().speculative.num_draft_tokens > 0
    (alone,) = engines["off"].generate(prompt_token_ids=[prefix + tail], sampling_params=params)
    assert hit.token_ids == alone.token_ids


@pytest.mark.parametrize("stop", [[], [" the"]], ids=["eos", "stop-string"])
def test_counts_are_what_the_output_got(stop):
    """Runs cut by the end of sequence or a stop string count only the tokens output: every
    verify step counts its accepted drafts plus one token, so over a request they add up to
    the tokens after its first (the prefill's), whatever drafts were accepted past the end."""
    engine = Engine(TRAINED, device="cpu", dtype="float32", context_length=256,
                    background_loop=False, skip_kernel_warmup=True,
                    speculative_algorithm="NEXTN", speculative_num_steps=3,
                    disable_speculative_speed_check=True, speculative_min_acceptance=0.0)
    try:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
                   for text in ("Tell me a story about a fox.", "What time is it?")]
        params = SamplingParams(max_tokens=120, temperature=0, stop=stop)
        results = engine.generate(prompts, params)
        choices = [r.choices[0] for r in results]
        assert all(c.finish_reason == "stop" and c.num_verify_steps > 0 for c in choices)
        for c in choices:
            assert c.num_accepted_tokens + c.num_verify_steps == len(c.token_ids) - 1
            assert c.num_accepted_tokens <= c.num_draft_tokens
        stats = engine.stats().speculative
        assert stats.num_accepted_tokens == sum(c.num_accepted_tokens for c in choices)
        assert stats.num_verify_steps == sum(c.num_verify_steps for c in choices)
    finally:
        engine.shutdown()


def test_metrics_report_acceptance(engines):
    from glmflash.server.metrics import ServerMetrics as Metrics

    engines["on"].generate(TEXTS[5], SamplingParams(max_tokens=6, temperature=0,
                                                    ignore_eos=True))
    text = Metrics(engines["on"]).render()
    stats = engines["on"].stats().speculative
    assert f"glmflash_spec_draft_tokens_total {stats.num_draft_tokens}\n" in text
    assert "glmflash_spec_acceptance_rate " in text and "glmflash_spec_drafting 1" in text
    assert "glmflash_spec_" not in Metrics(engines["off"]).render()


def test_committed_state_tracks_a_run_without_drafts():
    """After every step, the state slot of a sequence decoded with drafts holds what the same
    sequence without drafts holds at the same position. Equal to float rounding only: the
    verify's projections multiply more rows at once, which rounds differently (bit-for-bit
    equality given the same per-token inputs is tests/model/test_verify.py)."""
    options = dict(device="cpu", dtype="float32", background_loop=False, context_length=64,
                   max_running_requests=1, disable_radix_cache=True, skip_kernel_warmup=True)
    engines = {"on": Engine(TRAINED, **options, **SPEC), "off": Engine(TRAINED, **options)}
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seqs = {}
    for name, engine in engines.items():
        engine.add_request(engine.tokenizer.encode(TEXTS[0]), params, lambda delta: None)
        engine._drain_inbox(block=False)
        seqs[name] = engine.scheduler.waiting[0]
    on, off, compared, largest = seqs["on"], seqs["off"], 0, 0.0
    while not on.is_finished:
        engines["on"].step()
        while not off.is_finished and off.num_computed_tokens < on.num_computed_tokens:
            engines["off"].step()
        if on.is_finished or off.num_computed_tokens != on.num_computed_tokens:
            continue
        for name in ("recurrent", "conv", "index_tail"):
            for i, live in getattr(engines["off"].runner.state, name).items():
                drafted = getattr(engines["on"].runner.state, name)[i][on.state_slot]
                largest = max(largest, float((drafted - live[off.state_slot]).abs().max()))
        compared += 1
    assert compared >= 4 and engines["on"].stats().speculative.num_accepted_tokens > 0
    assert on.token_ids.tolist()[:len(off.token_ids)] == off.token_ids.tolist()
    assert largest < 1e-5, largest
