"""The verify and draft forwards of engine/spec_graphs.py on the CPU, with each "graph" replayed
as its recorded forward (engine/spec_capture.py) run again into the same output tensors (what a
CUDA graph replay does to its static outputs). This checks what the graphs compute, not the
capture: the padded verify batch, the draft rows (padding past each sequence's committed
positions and for finished sequences) and the rows drafted from, against the same engine
without drafts. The captures themselves run on the GPU (tests/engine/test_speculative_gpu.py)."""

from __future__ import annotations

import pytest

from glmflash import SamplingParams
from glmflash.engine.outputs import ResultCollector
from tests.engine.spec_helpers import SPEC, TEXTS, run_arrivals, spec_engine, with_graphs

SAMPLING = {"greedy": SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
            "seeded": SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)}


@pytest.mark.parametrize(("num_steps", "sampling"), [(1, "greedy"), (2, "greedy"),
                                                     (1, "seeded")])
def test_graph_forms_give_the_tokens_of_mtp_off(rerun_graphs, num_steps, sampling):
    """Greedy steps take the acceptance graph (`replay_greedy`), sampled ones the host's
    sampler between the verify and draft graphs."""
    params = SAMPLING[sampling]
    spec = {**SPEC, "speculative_num_steps": num_steps}
    outputs, counts = {}, {}
    for name, extra in (("off", {}), ("eager", spec), ("graphs", spec)):
        engine = spec_engine(pages=16, max_running_requests=4, **extra)
        graphs = with_graphs(engine, [1, 2, 4]) if name == "graphs" else None
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
        # Different arrivals and a short request: batches of 1-3 sequences padded to 1, 2 or
        # 4, and a sequence that finishes beside live ones.
        results = [c.result() for c in run_arrivals(engine, prompts, [0, 2, 5], params)]
        outputs[name] = [r.token_ids for r in results]
        stats = engine.stats().speculative
        if stats is not None:
            counts[name] = (stats.num_draft_tokens, stats.num_accepted_tokens)
        if graphs is not None:
            captured = graphs.verify_graphs.values()
            verifies = sum(v.graph.num_replays for v in captured)
            drafts = sum(v.draft.graph.num_replays for v in captured)
            accepts = sum(v.accept.graph.num_replays for v in captured)
            assert verifies == graphs.num_replays > 3
            # A step whose batch also prefills drafts eagerly after a replayed verify.
            assert 0 < drafts <= verifies
            assert accepts == (drafts if sampling == "greedy" else 0)
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert outputs["graphs"] == outputs["off"]
    # The draft graph drafts what the eager MTP forward drafts: the same drafts accepted.
    assert counts["graphs"] == counts["eager"]
    assert counts["graphs"][1] > 0.3 * counts["graphs"][0]


def _run_each(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    collectors = []
    for prompt, choice in zip(prompts, params, strict=True):
        collector = ResultCollector("", prompt, 1)
        collector.request_id = engine.add_request(prompt, choice, collector.add)
        collectors.append(collector)
    steps = 0
    while not all(c.is_done for c in collectors):
        engine.step()
        steps += 1
        assert steps < 400
    return [c.result().token_ids for c in collectors]


def test_sequences_with_fewer_drafts_take_padding_rows(rerun_graphs):
    """Short requests draft less near their end: the batch still replays the graphs (those
    sequences' rows past their drafts are padding) and gives the tokens of MTP off and of the
    eager verify."""
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)]
    spec = {**SPEC, "speculative_num_steps": 2}
    outputs, counts = {}, {}
    for name, extra in (("off", {}), ("eager", spec), ("graphs", spec)):
        engine = spec_engine(pages=16, max_running_requests=4, **extra)
        graphs = with_graphs(engine, [1, 2, 4]) if name == "graphs" else None
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:3]]
        outputs[name] = _run_each(engine, prompts, params)
        if engine.spec is not None:
            stats = engine.stats().speculative
            counts[name] = (stats.num_draft_tokens, stats.num_accepted_tokens)
        if graphs is not None:
            # Every step after the prefills verifies beside the request that never drafts.
            assert graphs.num_replays >= 8
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert outputs["graphs"] == outputs["off"]
    assert counts["graphs"] == counts["eager"]


def ban_two_most_likely(token_ids, logits):
    """A logits processor that changes the greedy choice at every step."""
    out = logits.clone()
    out[logits.topk(2).indices] = -float("inf")
    return out


@pytest.mark.parametrize("kind", ["processor", "penalties"])
def test_greedy_requests_with_processors_or_penalties_beside_drafts(rerun_graphs, kind):
    """A greedy request with a logits processor or penalties never drafts; batched with one
    that drafts, its tokens are still chosen from its processed logits (the graphs' greedy
    acceptance takes the raw argmax, so such a batch verifies eagerly)."""
    extra = {"logits_processors": [ban_two_most_likely]} if kind == "processor" else \
        {"repetition_penalty": 2.0, "frequency_penalty": 2.0}
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, **extra),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)]
    spec = {**SPEC, "speculative_num_steps": 2}
    outputs = {}
    for name, options in (("off", {}), ("graphs", spec)):
        engine = spec_engine(pages=16, max_running_requests=4, **options)
        if name == "graphs":
            with_graphs(engine, [1, 2, 4])
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
        outputs[name] = _run_each(engine, prompts, params)
        if name == "graphs":
            assert engine.stats().speculative.num_draft_tokens > 0
    assert outputs["graphs"] == outputs["off"]
