"""The prefix cache changes no token: greedy outputs with the cache equal those without it, for
every kind of hit length, across preemption and aborts, and against the oracle."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.options import EngineConfig
from glmflash.engine.outputs import ResultCollector
from glmflash.model.state import cache_bytes
from tests.oracle import assert_greedy_matches

# Embedded tiny model: k-pools of 4 tokens, top-16 pools (so past 64 tokens the selection is
# sparse); pages of 8 tokens.
ENGINE = dict(context_length=160, page_size=8, chunked_prefill_size=64, max_running_requests=8,
              background_loop=False, check_integrity=True, skip_kernel_warmup=True)
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
# Hit lengths: the next turn extends a previous prompt of this many tokens.
HIT_LENGTHS = {"inside_pool": 30, "pool_edge": 28, "page_edge": 32, "sparse_inside_page": 93,
               "sparse_page_edge": 96}


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    on = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", **ENGINE)
    off = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", disable_radix_cache=True,
                 **ENGINE)
    assert on.cache.radix is not None and off.cache.radix is None
    return on, off


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _both(engines, prompts: list[list[int]], params: SamplingParams = GREEDY):
    on = engines[0].generate(prompt_token_ids=prompts, sampling_params=params)
    off = engines[1].generate(prompt_token_ids=prompts, sampling_params=params)
    for a, b in zip(on, off, strict=True):
        assert a.token_ids == b.token_ids, f"cache on {a.token_ids} != off {b.token_ids}"
    return on


def test_hit_lengths_give_the_tokens_of_the_cache_off_engine_and_the_oracle(engines, oracles):
    firsts = {name: _tokens(n, seed=n) for name, n in HIT_LENGTHS.items()}
    firsts["whole_prompt_but_one"] = _tokens(45, seed=3)
    firsts["same_prompt_again"] = _tokens(50, seed=4)
    assert all(r.num_cached_tokens == 0 for r in _both(engines, list(firsts.values())))
    seconds = {name: p + _tokens(9, seed=1000 + len(p)) for name, p in firsts.items()}
    seconds["whole_prompt_but_one"] = firsts["whole_prompt_but_one"] + [5]
    seconds["same_prompt_again"] = firsts["same_prompt_again"]
    results = dict(zip(seconds, _both(engines, list(seconds.values())), strict=True))
    for name, n in HIT_LENGTHS.items():
        assert results[name].num_cached_tokens == n, name
    assert results["whole_prompt_but_one"].num_cached_tokens == 45
    # A token must be computed for the logits: the prompt-end snapshot is out of reach, the
    # last chunk end before it is not.
    assert 0 < results["same_prompt_again"].num_cached_tokens < 50
    for name in ("inside_pool", "sparse_inside_page", "same_prompt_again"):
        assert_greedy_matches(oracles["embedded"], seconds[name], results[name].token_ids)


def test_prefixes_cached_by_aborted_requests(engines):
    """One request aborted in its prefill, one in its decode; the next turns start from what
    each had cached (a chunk end, the prompt end)."""
    on = engines[0]
    prefill, decode = _tokens(100, seed=5), _tokens(40, seed=6)
    in_prefill = on.add_request(prefill, GREEDY, lambda delta: None)
    in_decode = on.add_request(decode, GREEDY, lambda delta: None)
    on.step()
    on.abort(in_prefill)
    on.step()
    on.step()
    on.abort(in_decode)
    on.step()
    assert not on.scheduler.has_work
    after_prefill, after_decode = _both(engines, [prefill + [1, 2], decode + [3]])
    assert 0 < after_prefill.num_cached_tokens < 100 and after_decode.num_cached_tokens == 40


def _small_cache_gb(tiny_dir, options: dict, pages: int) -> float:
    from glmflash.config import ModelConfig

    config = EngineConfig(**options)
    per_token, per_slot = cache_bytes(ModelConfig.from_hf(tiny_dir), torch.float32)
    slots = config.max_running_requests + config.num_state_snapshots
    return (slots * per_slot + pages * config.page_size * per_token) / 2**30


def test_preemption_with_shared_prefixes(tiny_dirs, engines):
    """A cache too small for the traffic: sequences are preempted, restart from cached
    prefixes (their own or others'), and still produce the tokens of the cache-off engine."""
    options = {**ENGINE, "context_length": 72, "max_state_snapshots": 3,
               "chunked_prefill_size": 16, "max_running_requests": 4}
    budget = _small_cache_gb(tiny_dirs["embedded"], options, pages=10)
    small = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", cache_budget_gb=budget,
                   **options)
    assert small.cache.plan.num_pages == 10
    stem = _tokens(40, seed=6)
    prompts = [stem[:n] + _tokens(k, seed=n + k) for n, k in ((40, 9), (33, 20), (17, 3),
                                                              (40, 1), (25, 30), (8, 8))]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    collectors = []
    for prompt in prompts:
        collector = ResultCollector("", prompt, 1)
        small.add_request(prompt, params, collector.add)
        collectors.append(collector)
        small.step()
    while small.scheduler.has_work:
        small.step()
    assert small.scheduler.num_preemptions > 0 and small.scheduler.num_hit_tokens > 0
    expected = engines[1].generate(prompt_token_ids=prompts, sampling_params=params)
    for collector, want in zip(collectors, expected, strict=True):
        assert collector.result().token_ids == want.token_ids


def test_media_are_part_of_the_key(engines):
    """Same text, other image: the hit stops before the image; same image: the whole turn."""
    from tests.multimodal.conftest import random_image

    def turn(image_seed: int, follow_up: bool):
        png = io.BytesIO()
        random_image(image_seed, 56, 56).save(png, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        image = {"type": "image_url", "image_url": {"url": url}}
        messages = [{"role": "user", "content": [image, {"type": "text", "text": "What?"}]}]
        if follow_up:
            messages += [{"role": "assistant", "content": "A square."},
                         {"role": "user", "content": "Sure?"}]
        results = [engine.chat(messages, sampling_params=GREEDY).result for engine in engines]
        assert results[0].token_ids == results[1].token_ids
        return results[0]

    first = turn(1, follow_up=False)
    image_at = first.prompt_token_ids.index(engines[0].config.image_token_id)
    assert turn(2, follow_up=True).num_cached_tokens <= image_at
    assert turn(1, follow_up=True).num_cached_tokens == len(first.prompt_token_ids)


@pytest.mark.gpu
def test_hits_on_the_gpu_give_the_tokens_of_the_cache_off_engine(tiny_dirs):
    """The Triton path: snapshots and page copies on the device, fp32 for exact comparison."""
    pair = [Engine(tiny_dirs["embedded"], device="cuda", dtype="float32",
                   disable_radix_cache=off, **ENGINE) for off in (False, True)]
    firsts = [_tokens(n, seed=n) for n in HIT_LENGTHS.values()]
    _both(pair, firsts)
    results = _both(pair, [p + _tokens(9, seed=1000 + len(p)) for p in firsts])
    assert [r.num_cached_tokens for r in results] == list(HIT_LENGTHS.values())
    for engine in pair:
        engine.shutdown()


def _finish_alone(engine, prompt, params, limit=150):
    """Drive one request to its end; a hang (no progress) fails."""
    collector = ResultCollector("", prompt, 1)
    engine.add_request(prompt, params, collector.add)
    for _ in range(limit):
        engine.step()
        if collector.is_done:
            return collector.result().token_ids
    raise AssertionError(f"not done after {limit} steps, {engine.scheduler.num_preemptions} "
                         f"preemptions, {engine.cache.num_free_pages} pages free")


def _random_prompt(n, seed):
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("case", ["mid-page hit", "chained mid-page hits", "prompt logprobs"])
def test_a_sequence_that_fits_alone_finishes_whatever_the_cache_pins(case):
    """Pages of 8 tokens, sequences of at most 5 pages, a cache of 5 or 8. A hit ending
    mid-page pins the tree's partial page beside the sequence's copy, chained mid-page hits one
    version of it per node, and a request asking for prompt log-probabilities (no hit) locks
    the nodes of the same cached prompt it computes again: each would leave too few pages for
    a sequence that fits the cache alone, which then went without the prefix cache."""
    from tests.engine.spec_helpers import spec_engine

    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    prompt = _random_prompt(32, seed=3)
    if case == "mid-page hit":
        pages, earlier = 5, [prompt[:20]]
    elif case == "chained mid-page hits":
        pages, earlier = 8, [prompt[:n] for n in (4, 5, 6, 7, 8)]
    else:
        pages, earlier = 8, [prompt]
        params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True, prompt_logprobs=1)
    want = _finish_alone(spec_engine(pages=pages), prompt, params)
    engine = spec_engine(pages=pages, disable_radix_cache=False)
    for turn in earlier:
        _finish_alone(engine, turn, one)
    assert _finish_alone(engine, prompt, params) == want
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
