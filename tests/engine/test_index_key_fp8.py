"""`index_key_dtype="fp8"` through the engine: the pooled-key cache is FP8 rows, the plan counts
their bytes, and a prompt gives the same greedy tokens whether it is prefilled whole or in
chunks of 7 with preemption-sized pages (every write path quantises the same pooled keys).
`index_query_dtype="fp8"` beside them: every selection scores e4m3 queries, and the engine's
greedy tokens are those of the model driven directly with that scoring."""

from __future__ import annotations

import pytest
import torch

import glmflash.model.indexer as indexer_module
from glmflash import Engine, SamplingParams
from glmflash.config import ModelConfig
from glmflash.engine.options import EngineConfig
from glmflash.model.state import ModelState
from tests.conftest import PackedRunner, load_tiny

# Prompts past the tiny model's 16 selected tokens (4 pools of 4), so the indexer chooses.
LENGTHS = (40, 29, 52)


def _engine(tiny_dir, device="cpu", **options):
    return Engine(tiny_dir, device=device, dtype="float32", context_length=96, page_size=8,
                  max_running_requests=3, background_loop=False, check_integrity=True,
                  **options)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in LENGTHS]


def _tokens(tiny_dir, prompts, device="cpu", max_tokens=12, **options) -> list[list[int]]:
    engine = _engine(tiny_dir, device, index_key_dtype="fp8", **options)
    assert all(t.dtype == torch.uint8 for t in engine.runner.state.pool_keys.values())
    assert engine.cache.plan.fp8_index_keys
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    results = engine.generate(prompt_token_ids=prompts, sampling_params=params)
    assert all(len(r.token_ids) == max_tokens for r in results)
    return [r.token_ids for r in results]


def test_fp8_keys_chunked_equals_whole_prefill(tiny_dirs, prompts):
    tiny = tiny_dirs["embedded"]
    assert _tokens(tiny, prompts, chunked_prefill_size=7) == \
        _tokens(tiny, prompts, chunked_prefill_size=2048)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("queries", ["auto", "fp8"])
def test_fp8_keys_gpu_graphs_and_chunks(tiny_dirs, prompts, queries, query_flags):
    """The Triton writes and scoring: whole prompts with decodes replayed from CUDA graphs,
    chunks of 7 with eager decodes, the same tokens (with e4m3 queries: every selection
    captured or eager scores them)."""
    tiny = tiny_dirs["embedded"]
    assert _tokens(tiny, prompts, "cuda", chunked_prefill_size=2048, index_query_dtype=queries) \
        == _tokens(tiny, prompts, "cuda", chunked_prefill_size=7, disable_cuda_graph=True,
                   index_query_dtype=queries)
    assert set(query_flags) == {queries == "fp8"}


def test_fp8_keys_plan_fewer_bytes_per_token(tiny_dirs):
    from glmflash.config import MLA, ModelConfig
    from glmflash.model.state import cache_bytes

    config = ModelConfig.from_hf(tiny_dirs["embedded"])
    plain, fp8 = (cache_bytes(config, torch.bfloat16, flag)[0] for flag in (False, True))
    full = sum(1 for kind, index in zip(config.layer_types, config.indexer_types, strict=True)
               if kind == MLA and index == "full")
    dim, kpool = config.index_head_dim, config.index_kpool
    assert plain - fp8 == full * (-(-2 * dim // kpool) - -(-(dim + 16) // kpool))


def test_index_key_dtype_checked():
    with pytest.raises(ValueError, match="index_key_dtype"):
        EngineConfig(index_key_dtype="fp16")


def test_fp8_keys_prefix_cache_hits_keep_the_tokens(tiny_dirs, prompts):
    """Cached prefixes (pages of FP8 rows copied for a new reader, state snapshots) give the
    tokens of prefilling the whole prompt."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    longer = [p + prompts[1][:13] for p in prompts[:2]]
    cached = _engine(tiny_dirs["embedded"], index_key_dtype="fp8", chunked_prefill_size=16)
    cached.generate(prompt_token_ids=prompts[:2], sampling_params=params)
    hits = cached.generate(prompt_token_ids=longer, sampling_params=params)
    assert all(r.num_cached_tokens > 0 for r in hits)
    assert [r.token_ids for r in hits] == _tokens(tiny_dirs["embedded"], longer,
                                                  chunked_prefill_size=16,
                                                  disable_radix_cache=True, max_tokens=8)


@pytest.fixture
def query_flags(monkeypatch) -> list[bool]:
    """The `fp8_queries` of every `indexer_select` the model makes while the test runs."""
    seen = []

    def select(*args, fp8_queries: bool = False, **kwargs):
        seen.append(fp8_queries)
        return real(*args, fp8_queries=fp8_queries, **kwargs)

    real = indexer_module.indexer_select
    monkeypatch.setattr(indexer_module, "indexer_select", select)
    return seen


@pytest.mark.parametrize("queries", ["auto", "fp8"])
def test_fp8_keys_mtp_keeps_the_tokens_of_mtp_off(queries, query_flags):
    """Drafts verified over FP8 pooled keys (the verify write, its scratch tails) give the
    greedy tokens of decoding without drafts, over chunks and preemption; with e4m3 queries
    every selection (prefill, decode, MTP layer, verify) scores them."""
    from tests.engine.spec_helpers import SPEC, TEXTS, run_arrivals, spec_engine

    outputs = {}
    for name, extra in (("off", {}), ("on", {**SPEC, "disable_speculative_speed_check": True})):
        engine = spec_engine(index_key_dtype="fp8", index_query_dtype=queries, **extra)
        prompts = [engine.tokenizer.encode(t) for t in TEXTS[:4]]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        results = run_arrivals(engine, prompts, [0, 0, 1, 3], params)
        outputs[name] = [c.result().token_ids for c in results]
    assert outputs["on"] == outputs["off"]
    assert engine.stats().speculative.num_draft_tokens > 10
    assert set(query_flags) == {queries == "fp8"}


def test_fp8_queries_need_fp8_keys(tiny_dirs):
    with pytest.raises(ValueError, match="index_query_dtype 'fp8' needs index_key_dtype 'fp8'"):
        EngineConfig(index_query_dtype="fp8")
    with pytest.raises(ValueError, match="index_query_dtype 'bf16' must be one of"):
        EngineConfig(index_key_dtype="fp8", index_query_dtype="bf16")
    assert EngineConfig(index_key_dtype="fp8", index_query_dtype="fp8").fp8_index_queries
    assert not EngineConfig(index_key_dtype="fp8").fp8_index_queries
    with pytest.raises(ValueError, match="fp8_index_queries needs fp8_index_keys"):
        ModelState(ModelConfig.from_hf(tiny_dirs["embedded"]), num_token_slots=64,
                   num_state_slots=1, dtype=torch.float32, device="cpu", fp8_index_queries=True)


def _direct_tokens(tiny_dir, prompts, max_tokens=12, **state_options) -> list[list[int]]:
    """Greedy tokens of the model driven without the engine, over FP8 pooled keys: each
    prompt prefilled whole, then one token per step."""
    runner = PackedRunner(load_tiny(tiny_dir), len(prompts), max_len=96, fp8_index_keys=True,
                          **state_options)
    step = runner.forward(dict(enumerate(prompts)), all_logits=False).argmax(-1).tolist()
    tokens = [[t] for t in step]
    for _ in range(max_tokens - 1):
        step = runner.forward({s: [t] for s, t in enumerate(step)},
                              all_logits=False).argmax(-1).tolist()
        for out, t in zip(tokens, step, strict=True):
            out.append(t)
    return tokens


def test_fp8_queries_tokens_are_the_direct_models(tiny_dirs, prompts, query_flags):
    """The engine (chunks of 7, decode batches) with e4m3 queries gives the greedy tokens of
    the model driven directly with them; on these prompts the e4m3 queries change the tokens
    (random weights: pools score close together), so an engine that dropped the flag fails."""
    tiny = tiny_dirs["embedded"]
    got = _tokens(tiny, prompts, index_query_dtype="fp8", chunked_prefill_size=7)
    assert query_flags and all(query_flags)
    want = _direct_tokens(tiny, prompts, fp8_index_queries=True)
    assert got == want
    assert want != _direct_tokens(tiny, prompts)
