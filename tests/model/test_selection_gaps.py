"""tests/selection_margins.py measures what it claims: repeated text puts the random tiny
model's indexer at a rounding-level tie, text without repeats keeps its choices far apart."""

from __future__ import annotations

from glmflash import Engine, SamplingParams
from tests.model.test_gpu import GREEDY_PROMPTS, SELECTION_GAP
from tests.selection_margins import smallest_selection_gap


def test_repeated_text_ties_and_the_greedy_prompts_do_not(tiny_dirs):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    engine = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=512)
    try:
        repeated = smallest_selection_gap(engine, "A much longer prompt " * 8, params)
        gaps = [smallest_selection_gap(engine, p, params) for p in GREEDY_PROMPTS]
    finally:
        engine.shutdown()
    assert repeated < 1e-5, repeated  # measured 1.2e-7
    assert min(gaps) > SELECTION_GAP, gaps
