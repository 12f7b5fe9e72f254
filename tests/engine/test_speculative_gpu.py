"""Speculative decoding on CUDA with the trained tiny model: greedy tokens equal MTP off, all-GPU
and hybrid (the main model's experts on the CPU, inside the verify graphs; the MTP layer's on the
GPU), with the verify and draft forwards replayed from CUDA graphs (engine/spec_graphs.py) where
every sequence has all its drafts; seeded sampling draws the same tokens; drafting held off
keeps the MTP layer's cache through the decode and draft graphs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from glmflash import Engine, SamplingParams
from glmflash.tiny.embedded import embedded_checkpoint
from tests.engine.spec_helpers import SPEC, mtp_cache, run_arrivals, spec_engine, start_request

pytestmark = pytest.mark.gpu

TRAINED = embedded_checkpoint()
TEXTS = ["Once upon a time, a little fox", "The cat sat on the", "Tom has three apples and",
         "In the morning the sun", "A dog ran to the park and", "Hello! My name is"]
PLACEMENTS = {"all-gpu": {}, "hybrid-0": dict(kt_num_gpu_experts=0, kt_cpuinfer=2)}


def _outputs(options: dict, params: list[SamplingParams]) -> tuple[list[list[int]], object]:
    engine = Engine(TRAINED, device="cuda", dtype="float32", context_length=256,
                    max_running_requests=4, background_loop=False, **options)
    try:
        prompts = [engine.tokenizer.encode(t) for t in TEXTS]
        results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
        if engine.spec is not None:
            graphs = engine.spec.runner.graphs
            assert graphs is not None and graphs.num_replays > 0
        return [r.token_ids for r in results], engine.stats().speculative
    finally:
        engine.shutdown()


GREEDY = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)] * len(TEXTS)


@pytest.fixture(scope="module")
def greedy_off() -> Callable[[str], list[list[int]]]:
    """MTP off, per placement, computed once for the module (each engine start compiles and
    captures)."""
    cache: dict[str, list[list[int]]] = {}

    def tokens(placement: str) -> list[list[int]]:
        if placement not in cache:
            cache[placement] = _outputs(PLACEMENTS[placement], GREEDY)[0]
        return cache[placement]
    return tokens


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("num_steps", [1, 2])
def test_greedy_tokens_match_mtp_off_on_cuda(greedy_off, placement, num_steps):
    params = GREEDY
    off = greedy_off(placement)
    on, stats = _outputs({**PLACEMENTS[placement], "speculative_algorithm": "NEXTN",
                          "speculative_num_steps": num_steps}, params)
    assert on == off
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.3


def test_greedy_tokens_match_mtp_off_with_chunks_and_arrivals_on_cuda():
    """Prompts arriving over steps and prefilled in chunks of 7 beside the verifies of the
    sequences already decoding (steps that mix chunks and drafts): the tokens of MTP off."""
    prompts, arrivals = TEXTS[:4], [0, 0, 1, 3]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outputs, stats = {}, None
    for name, extra in (("off", {}), ("on", {**SPEC, "disable_speculative_speed_check": True})):
        engine = spec_engine(device="cuda", **extra)
        try:
            encoded = [engine.tokenizer.encode(t) for t in prompts]
            results = [c.result() for c in run_arrivals(engine, encoded, arrivals, params)]
            outputs[name] = [r.token_ids for r in results]
            stats = engine.stats().speculative
        finally:
            engine.shutdown()
    assert outputs["on"] == outputs["off"]
    assert stats.num_draft_tokens > 10 and stats.acceptance_rate > 0.3


def test_seeded_sampling_matches_mtp_off_on_cuda():
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True)
              for s in range(len(TEXTS))]
    off, _ = _outputs({}, params)
    on, _ = _outputs({"speculative_algorithm": "NEXTN"}, params)
    assert on == off


def _held_run(engine: Engine, holds: dict[int, int]) -> tuple[list[int], list, list[tuple]]:
    """Greedy TEXTS[0] until it has computed its prompt and 20 more positions (drafting paused
    at the steps of `holds`), then to its end: its tokens, its MTP cache over those positions,
    and per step the replays of the decode, verify and draft graphs."""
    prompt = engine.tokenizer.encode(TEXTS[0])
    compared = len(prompt) + 20
    collector, seq = start_request(engine, prompt, GREEDY[0])
    graphs, spec = engine.runner.graphs, engine.spec.runner.graphs

    def replays() -> tuple[int, int, int]:
        return graphs.num_replays, spec.num_replays, spec.num_draft_replays

    steps, step = [], 0
    while seq.num_computed_tokens < compared:
        if step in holds:
            engine.spec.policy.num_paused_steps = holds[step]
        before = replays()
        engine.step()
        steps.append(tuple(b - a for a, b in zip(before, replays(), strict=True)))
        step += 1
    cache = mtp_cache(engine, seq, compared)
    while not collector.is_done:
        engine.step()
    return collector.result().token_ids, cache, steps


def test_drafting_held_off_keeps_the_mtp_cache_on_cuda(greedy_off):
    """Drafting paused for a stretch of decodes: those steps replay the decode graph and fill
    the MTP layer's cache through the draft graph (no verify), the cache equals that of a run
    that drafted all along (to the rounding of the different forwards: a position the fill
    missed keeps zeros, a relative error of 1), and the greedy tokens equal MTP off."""
    options = dict(device="cuda", dtype="float32", context_length=256, max_running_requests=4,
                   background_loop=False, speculative_algorithm="NEXTN",
                   speculative_num_steps=1, disable_speculative_speed_check=True,
                   speculative_min_acceptance=0.0)
    runs = {}
    for name, holds in (("along", {}), ("held", {8: 6})):
        engine = Engine(TRAINED, **options)
        try:
            runs[name] = _held_run(engine, holds)
        finally:
            engine.shutdown()
    off = greedy_off("all-gpu")[0]
    assert runs["held"][0] == runs["along"][0] == off
    # Step 8 verifies the drafts made before the pause; steps 9-12 are held off.
    assert runs["held"][2][9:13] == [(1, 0, 1)] * 4, runs["held"][2]
    for held, along in zip(runs["held"][1], runs["along"][1], strict=True):
        error = ((held - along).norm(dim=-1) / along.norm(dim=-1)).max().item()
        assert error < 0.05, error
