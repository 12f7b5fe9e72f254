"""The first Engine: greedy tokens equal the oracle's on each prompt alone; sampling options."""

from __future__ import annotations

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.sampler import filtered_probs
from tests.oracle import assert_greedy_matches


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", max_running_requests=3)


def test_greedy_matches_oracle_for_concurrent_prompts(engine, oracles):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 31, 12, 47, 2)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, result in zip(prompts, results, strict=True):
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
        assert_greedy_matches(oracles["embedded"], prompt, result.token_ids)


def test_text_prompt_and_logprobs(engine):
    (result,) = engine.generate("Hello there", SamplingParams(max_tokens=4, temperature=0,
                                                              logprobs=3, ignore_eos=True))
    assert result.prompt_token_ids == engine.tokenizer.encode("Hello there")
    assert len(result.logprobs) == 4
    for token, step in zip(result.token_ids, result.logprobs, strict=True):
        assert token in step and len(step) == 3
        assert max(step.values()) == step[token]  # greedy picks the most likely
        assert all(v <= 0 for v in step.values())


def test_stop_token_and_stop_string(engine):
    base = engine.generate("abc", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_id = base.token_ids[2]
    first = base.token_ids.index(stop_id)
    (r,) = engine.generate("abc", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                 stop_token_ids=[stop_id]))
    assert r.finish_reason == "stop" and r.token_ids == base.token_ids[: first + 1]
    text = engine.tokenizer.decode(base.token_ids)
    stop = next(text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].strip())
    (r,) = engine.generate("abc", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                 stop=[stop], skip_special_tokens=False))
    assert r.finish_reason == "stop" and stop not in r.text and text.startswith(r.text)


def test_seeded_sampling_is_independent_of_batch(engine):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=123, ignore_eos=True)
    alone = engine.generate("seeded", params)[0].token_ids
    others = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    mixed = engine.generate(["x y z", "seeded", "q"], [others, params, others])[1].token_ids
    assert alone == mixed


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompts="a", prompt_token_ids=[1]), "exactly one"),
    (dict(prompt_token_ids=[[]]), "at least one token"),
    (dict(prompt_token_ids=[[5000]]), "must be in"),
    (dict(prompts=["a", "b"], media=[None]), "media has 1 entries for 2 prompts"),
])
def test_bad_requests_raise(engine, kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(**kwargs)


def test_filtered_probs_masks():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.count_nonzero(filtered_probs(logits, 2, 1.0, 0.0)) == 2
    # top-p 0.8 keeps the smallest prefix with mass >= 0.8: 0.5 + 0.2 + 0.15.
    assert torch.count_nonzero(filtered_probs(logits, 0, 0.8, 0.0)) == 3
    # min-p 0.25 keeps probabilities >= 0.125.
    assert torch.count_nonzero(filtered_probs(logits, 0, 1.0, 0.25)) == 3
    assert torch.isclose(filtered_probs(logits, 0, 1.0, 0.0).sum(), torch.tensor(1.0))
