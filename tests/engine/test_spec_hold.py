"""Drafting held off, then resumed: the MTP layer's cache follows every position a sequence that
may draft commits while drafting is off (prompt chunks and decodes), eagerly and through the draft
graph, so the drafts after a pause read the cache of a run that drafted all along; a sequence
that never drafts (a penalty) pays no MTP forward for its decodes."""

from __future__ import annotations

import pytest
import torch

from glmflash import SamplingParams
from glmflash.engine.sequence import Sequence
from tests.engine.spec_helpers import (
    SPEC,
    TEXTS,
    mtp_cache,
    spec_engine,
    start_request,
    with_graphs,
)

# Neither the speed check nor the acceptance pause holds drafting off on their own: the test
# alone does (`DraftPolicy.num_paused_steps`).
ALONG = {**SPEC, "speculative_num_steps": 1, "disable_speculative_speed_check": True,
         "speculative_min_acceptance": 0.0}
PARAMS = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
# Engine step -> steps drafting is then paused for: the prompt's chunks and first decodes, then
# a stretch of decodes.
HOLDS = {0: 8, 11: 6}
# Positions compared: the prompt and the first outputs (the sequence is still running).
COMPARED_OUTPUTS = 22


def _step_until(engine, seq: Sequence, num_tokens: int,
                holds: dict[int, int]) -> list[tuple[int, int]]:
    """Steps until `seq` has computed `num_tokens`; the verify and draft graphs' replays in
    each step."""
    replays, step = [], 0
    while seq.num_computed_tokens < num_tokens:
        if step in holds:
            engine.spec.policy.num_paused_steps = holds[step]
        before = _replays(engine)
        engine.step()
        replays.append(tuple(b - a for a, b in zip(before, _replays(engine), strict=True)))
        step += 1
        assert step < 200 and not seq.is_finished
    return replays


def _replays(engine) -> tuple[int, int]:
    graphs = engine.spec.runner.graphs
    if graphs is None:
        return 0, 0
    drafts = sum(v.draft.graph.num_replays for v in graphs.verify_graphs.values())
    assert graphs.num_draft_replays == drafts  # the runner's count (the GPU test reads it)
    return graphs.num_replays, drafts


@pytest.mark.parametrize("form", ["eager", "graphs"])
def test_positions_committed_while_held_off_fill_the_mtp_cache(request, form):
    """A run held off twice (its prompt and first decodes, then a stretch of decodes) has the MTP
    cache of a run that drafted all along, and the tokens of MTP off. Equal to float rounding
    only: the MTP layer's projections of one row or of several round differently."""
    if form == "graphs":
        request.getfixturevalue("rerun_graphs")
    engines = {name: spec_engine(pages=16, **options) for name, options in
               (("off", {}), ("along", ALONG), ("held", ALONG))}
    prompt = engines["off"].tokenizer.encode(TEXTS[0])
    caches, results, replays = {}, {}, {}
    for name in ("held", "along"):
        engine = engines[name]
        if form == "graphs":
            with_graphs(engine, [1, 2])
        collector, seq = start_request(engine, prompt, PARAMS)
        compared = len(prompt) + COMPARED_OUTPUTS
        replays[name] = _step_until(engine, seq, compared, HOLDS if name == "held" else {})
        caches[name] = mtp_cache(engine, seq, compared)
        while not collector.is_done:
            engine.step()
        results[name] = collector.result().token_ids
    results["off"] = engines["off"].generate(prompt_token_ids=[prompt],
                                             sampling_params=PARAMS)[0].token_ids
    assert results["held"] == results["along"] == results["off"]
    for held, along in zip(caches["held"], caches["along"], strict=True):
        assert along.abs().amax(dim=-1).min() > 0.1  # every row written
        assert torch.allclose(held, along, rtol=0, atol=1e-5), (held - along).abs().max()
    if form == "graphs":
        # The decode steps held off (after the one that verifies the drafts made before the
        # pause) replay no verify, and the draft graph fills the cache.
        first, last = 12, 11 + HOLDS[11] - 2
        assert replays["held"][first: last + 1] == [(0, 1)] * (last + 1 - first), replays
    assert engines["held"].stats().speculative.num_draft_tokens > 0


@pytest.mark.usefixtures("rerun_graphs")
def test_a_batch_above_the_drafting_limit_fills_the_mtp_cache_in_graph_sized_parts():
    """Three sequences above `speculative_max_batch_size` 2: drafting is off until the short one
    ends; meanwhile each decode step fills the MTP cache through the draft graphs, two sequences
    then one (the largest graph holds two). The two long sequences' caches equal those of a run
    that drafted all along, and the tokens those of MTP off."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 24, 24)]
    limits = {"held": 2, "along": 3}
    prompts = [spec_engine(pages=16).tokenizer.encode(t) for t in TEXTS[1:4]]
    caches, results = {}, {}
    for name, limit in limits.items():
        engine = spec_engine(pages=16, **{**ALONG, "speculative_max_batch_size": limit})
        with_graphs(engine, [1, 2])
        started = [start_request(engine, p, q) for p, q in zip(prompts, params, strict=True)]
        seqs, replays = [seq for _, seq in started], []
        while seqs[0].num_output_tokens < 3 or \
                min(s.num_computed_tokens - s.num_prompt_tokens for s in seqs[1:]) < 14:
            before = _replays(engine)
            engine.step()
            replays.append(tuple(b - a for a, b in zip(before, _replays(engine), strict=True)))
            assert not seqs[1].is_finished and not seqs[2].is_finished
        caches[name] = [mtp_cache(engine, s, s.num_prompt_tokens + 14) for s in seqs[1:]]
        while not all(c.is_done for c, _ in started):
            engine.step()
        results[name] = [c.result().token_ids for c, _ in started]
        if name == "held":
            # Decode steps of all three: no verify, two draft graph replays.
            assert replays.count((0, 2)) >= 2, str(replays)
    off = spec_engine(pages=16)
    results["off"] = [r.token_ids for r in off.generate(prompt_token_ids=prompts,
                                                         sampling_params=params)]
    assert results["held"] == results["along"] == results["off"]
    for held, along in zip(caches["held"], caches["along"], strict=True):
        for h, a in zip(held, along, strict=True):
            assert torch.allclose(h, a, rtol=0, atol=1e-5), (h - a).abs().max()


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_sequence_that_never_drafts_pays_no_mtp_forward_for_its_decodes(prefix_cache):
    """The penalty sequence's prompt runs through the MTP layer only when the prefix cache may
    give its pages to a sequence that drafts; its decodes never do, held off or not, while the
    sequence beside it that may draft fills every position."""
    engine = spec_engine(pages=16, disable_radix_cache=not prefix_cache, **ALONG)
    calls: list[tuple[int, int, int]] = []
    spec = engine.spec.runner
    draft_extend = spec.draft_extend

    def recording(rows, num_drafting):
        calls.extend((s.seq_id, start, count) for s, start, count in
                     zip(rows.seqs, rows.starts, rows.counts, strict=True))
        return draft_extend(rows, num_drafting)

    spec.draft_extend = recording
    penalty = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=0.5)
    plain = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [engine.tokenizer.encode(t) for t in TEXTS[:2]]
    seqs = [start_request(engine, p, params)[1] for p, params in zip(prompts, (penalty, plain),
                                                               strict=True)]
    for step in range(40):
        if step == 10:
            engine.spec.policy.num_paused_steps = 6
        engine.step()
    assert all(s.is_finished for s in seqs)
    assert engine.stats().speculative.num_draft_tokens > 0
    covered = {s.seq_id: set() for s in seqs}
    for seq_id, start, count in calls:
        covered[seq_id].update(range(start, start + count))
    never, drafts = seqs
    prompt_positions = set(range(never.num_prompt_tokens))
    assert covered[never.seq_id] == (prompt_positions if prefix_cache else set())
    # Every position of the other sequence but those of its last step (it finished there).
    assert covered[drafts.seq_id] == set(range(max(covered[drafts.seq_id]) + 1))
    assert max(covered[drafts.seq_id]) >= drafts.num_tokens - 2 - ALONG["speculative_num_steps"]


def test_held_off_steps_with_preemption_keep_the_tokens():
    """Drafting paused over the prefills, preemptions and recomputations of four requests in
    five pages: the tokens of MTP off, every page and slot back at the end."""
    engines = {"off": spec_engine(), "held": spec_engine(**ALONG)}
    prompts = [engines["off"].tokenizer.encode(t) for t in TEXTS[:4]]
    arrivals, params = [0, 0, 1, 3], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outputs = {}
    for name, engine in engines.items():
        collectors, step = [], 0
        while step <= max(arrivals) or not all(c.is_done for c in collectors):
            collectors += [start_request(engine, p, params)[0]
                           for p, at in zip(prompts, arrivals, strict=True) if at == step]
            if name == "held" and step in (0, 12):
                engine.spec.policy.num_paused_steps = 8
            engine.step()
            step += 1
            assert step < 400
        assert engine.scheduler.num_preemptions > 0, name
        assert engine.cache.num_free_pages == engine.cache.plan.num_pages
        outputs[name] = [c.result().token_ids for c in collectors]
    assert outputs["held"] == outputs["off"]
    assert engines["held"].stats().speculative.num_accepted_tokens > 0


def test_a_prefix_cached_while_held_off_carries_the_mtp_cache():
    """A prompt prefilled while drafting is held off leaves pages (and a snapshot) whose MTP
    rows a later request that hits the prefix cache reads: they equal those left by a prompt
    prefilled while drafting was on."""
    caches = {}
    for name, paused in (("held", 100), ("along", 0)):
        engine = spec_engine(pages=16, disable_radix_cache=False, **ALONG)
        prefix = engine.tokenizer.encode("Once upon a time, a little fox lived in the woods. ")
        engine.spec.policy.num_paused_steps = paused
        engine.generate(prompt_token_ids=[prefix],
                        sampling_params=SamplingParams(max_tokens=2, temperature=0))
        engine.spec.policy.num_paused_steps = 0
        collector, seq = start_request(engine, prefix + engine.tokenizer.encode("The fox"),
                                SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        engine.step()
        assert seq.num_cached_tokens >= engine.cache.page_size, seq.num_cached_tokens
        caches[name] = mtp_cache(engine, seq, seq.num_cached_tokens)
        while not collector.is_done:
            engine.step()
    for held, along in zip(caches["held"], caches["along"], strict=True):
        assert along.abs().amax(dim=-1).min() > 0.1
        assert torch.allclose(held, along, rtol=0, atol=1e-5), (held - along).abs().max()
