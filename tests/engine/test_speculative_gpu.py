"""Speculative decoding on CUDA with the trained tiny model: greedy tokens equal MTP off, all-GPU
and hybrid (the main model's experts on the CPU, inside the verify graphs; the MTP layer's on the
GPU), with the verify and draft forwards replayed from CUDA graphs (engine/spec_graphs.py) where
every sequence has all its drafts; seeded sampling draws the same tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from glmflash import Engine, SamplingParams
from glmflash.tiny.embedded import embedded_checkpoint

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


def test_seeded_sampling_matches_mtp_off_on_cuda():
    params = [SamplingParams(max_tokens=16, temperature=0.8, seed=s, ignore_eos=True)
              for s in range(len(TEXTS))]
    off, _ = _outputs({}, params)
    on, _ = _outputs({"speculative_algorithm": "NEXTN"}, params)
    assert on == off
