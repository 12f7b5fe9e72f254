"""SamplingParams.prompt_logprobs: the prompt's teacher-forced log-softmax, chunked or not."""

from __future__ import annotations

import pytest
import torch

from glmflash import Engine, SamplingParams
from tests.conftest import PackedRunner, load_tiny

# fp32 on the tiny model, against the teacher-forced forward in the engine's chunks (measured:
# <= 5e-7). Chunking itself moves the log-softmax by up to 2.5e-4 (chunks of 7 against one
# forward), the model's own chunked-prefill spread (tests/conftest.py LOGIT_ATOL).
LOGPROB_ATOL = 1e-5
CHUNK = 7


@pytest.fixture(scope="module")
def engines(tiny_dirs):
    """A batching engine that prefills each prompt whole, and one that prefills a prompt at a
    time in chunks of CHUNK tokens."""
    path = tiny_dirs["embedded"]
    options = dict(device="cpu", dtype="float32", skip_kernel_warmup=True)
    return [Engine(path, max_running_requests=3, **options),
            Engine(path, max_running_requests=1, chunked_prefill_size=CHUNK, **options)]


@pytest.fixture(scope="module")
def teacher_forced(tiny_dirs):
    model = load_tiny(tiny_dirs["embedded"])

    def log_softmax(prompt: list[int], chunk: int) -> torch.Tensor:
        runner = PackedRunner(model, 1)
        logits = [runner.forward({0: prompt[i:i + chunk]}) for i in range(0, len(prompt), chunk)]
        return torch.log_softmax(torch.cat(logits).float(), dim=-1)
    return log_softmax


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (1, 2, 23, 41)]


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunks-of-7"])
def test_prompt_logprobs_equal_teacher_forced_log_softmax(engines, teacher_forced, chunked):
    engine = engines[chunked]
    prompts = _prompts()
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    for prompt, result in zip(prompts, results, strict=True):
        entries = result.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        expected = teacher_forced(prompt, CHUNK if chunked else len(prompt))
        for p, entry in enumerate(entries[1:]):
            row, token = expected[p], prompt[p + 1]
            assert entry[token] == pytest.approx(row[token].item(), abs=LOGPROB_ATOL)
            top = row.topk(3)
            for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert entry[token_id] == pytest.approx(value, abs=LOGPROB_ATOL)
            assert len(entry) in (3, 4)


def test_zero_alternatives_keep_the_prompt_token(engines):
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    (result,) = engines[0].generate(prompt_token_ids=[[7, 8, 9]], sampling_params=params)
    assert [None if e is None else list(e) for e in result.prompt_logprobs] == [None, [8], [9]]


def test_requests_that_do_not_ask_are_unchanged(engines):
    """Beside a request that asks, the others' tokens and logprobs are those of the same batch
    where nobody asks, and they carry no prompt logprobs."""
    engine = engines[0]
    prompts = _prompts()[2:] + _prompts()[3:]
    plain = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2)
    asking = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=1)
    before = engine.generate(prompt_token_ids=prompts, sampling_params=plain)
    after = engine.generate(prompt_token_ids=prompts, sampling_params=[plain, plain, asking])
    for old, new in zip(before, after, strict=True):
        assert new.token_ids == old.token_ids
        for old_step, new_step in zip(old.logprobs, new.logprobs, strict=True):
            assert new_step == pytest.approx(old_step, abs=LOGPROB_ATOL)
    assert [r.prompt_logprobs is None for r in after] == [True, True, False]
    assert len(after[2].prompt_logprobs) == len(prompts[2])


def test_every_choice_gets_them_and_bad_values_raise(engines):
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=3, prompt_logprobs=1)
    (result,) = engines[0].generate(prompt_token_ids=[[5, 6, 7, 8]], sampling_params=params, n=2)
    assert len(result.prompt_logprobs) == 4
    # Nothing is left tracked: later steps skip the prompt-logprob pass entirely.
    assert all(not engine.runner.prompt_logprobs.missing for engine in engines)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_are_the_same_with_the_prefix_cache_warm(tiny_dirs):
    """A prompt already in the prefix cache is computed whole when it asks for prompt
    log-probabilities, so they equal those of a cache-off engine."""
    path = tiny_dirs["embedded"]
    options = dict(device="cpu", dtype="float32", skip_kernel_warmup=True, chunked_prefill_size=8)
    prompt = _prompts()[3]
    greedy = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    warm = Engine(path, **options)
    cold = Engine(path, disable_radix_cache=True, **options)
    try:
        warm.generate(prompt_token_ids=[prompt], sampling_params=greedy)  # fills the cache
        again = warm.generate(prompt_token_ids=[prompt + [7]], sampling_params=greedy)[0]
        assert again.choices[0].num_cached_tokens > 0, "the cache should hit without logprobs"
        got = warm.generate(prompt_token_ids=[prompt], sampling_params=scored)[0]
        want = cold.generate(prompt_token_ids=[prompt], sampling_params=scored)[0]
        assert got.choices[0].num_cached_tokens == 0
        assert got.prompt_logprobs == want.prompt_logprobs
    finally:
        warm.shutdown()
        cold.shutdown()
