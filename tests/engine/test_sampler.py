"""The batched sampler: greedy is argmax, seeded rows ignore the rest of the batch, filters and
temperature give the filtered distribution, penalties follow the spec as tokens accumulate,
logprobs are those of the raw row, and a raising logits processor fails only its row."""

from __future__ import annotations

import math
import random

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.penalties import apply_penalties
from glmflash.engine.rng import mix64, to_int64
from glmflash.engine.sampler import Sampler, filtered_probs
from glmflash.engine.sampling_tensors import SamplingTensors
from glmflash.engine.sequence import Sequence
from glmflash.server.processors import ForcedToolCall, LogitBias, ToolTokenIds

VOCAB = 50
# Each filter below, on this distribution after its temperature, keeps 4 to 6 of the 12 tokens,
# and no token's probability (min-p) or mass before it (top-p) is within 0.002 of the cut.
PROBS = [0.3, 0.2, 0.15, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01, 0.007, 0.003]


def _seq(seq_id: int, params: SamplingParams, prompt=(1, 2, 3), outputs=()) -> Sequence:
    seq = Sequence(seq_id, list(prompt), params)
    seq.token_ids.extend(outputs)
    return seq


def _logits(num_rows: int, seed: int = 42, vocab_size: int = VOCAB) -> torch.Tensor:
    return 3 * torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(seed))


def _boom(_output_ids, _logits):
    raise RuntimeError("boom")


def test_mix64_is_splitmix64():
    mask = (1 << 64) - 1

    def reference(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        return x ^ (x >> 31)

    rng = random.Random(42)
    values = [rng.getrandbits(64) for _ in range(4000)] + [0, 1, mask, 1 << 63, (1 << 63) - 1]
    out = mix64(torch.tensor([to_int64(v) for v in values])).tolist()
    assert out == [to_int64(reference(v)) for v in values]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = _logits(7).to(dtype)
    plain = [_seq(i, SamplingParams(temperature=0)) for i in range(7)]
    assert Sampler().sample(logits, plain) == logits.argmax(dim=-1).tolist()
    with_logprobs = [_seq(i, SamplingParams(temperature=0, logprobs=2)) for i in range(7)]
    assert Sampler().sample(logits, with_logprobs) == logits.argmax(dim=-1).tolist()


def _others() -> list[SamplingParams]:
    return [SamplingParams(temperature=0), SamplingParams(temperature=1.0),
            SamplingParams(temperature=0.7, top_k=5, seed=99, logprobs=2),
            SamplingParams(temperature=1.2, repetition_penalty=1.3, frequency_penalty=0.4,
                           logits_processors=[LogitBias({4: 3.0})])]


def test_seeded_row_is_independent_of_the_batch():
    params = SamplingParams(temperature=0.9, top_k=30, top_p=0.95, min_p=0.01, seed=1234)
    row = _logits(1, seed=7)
    alone = Sampler(0).sample(row, [_seq(100, params, outputs=[5, 6])])
    others = _others()
    for index in range(5):
        params_list = others[:index] + [params] + others[index:]
        logits = _logits(5, seed=index)
        logits[index] = row[0]
        seqs = [_seq(i, p, outputs=[5, 6]) for i, p in enumerate(params_list)]
        assert Sampler(index).sample(logits, seqs)[index] == alone[0]
    # The draw does depend on the seed and on the output position.
    by_seed = {Sampler().sample(row, [_seq(0, SamplingParams(temperature=1.0, seed=s))])[0]
               for s in range(40)}
    by_position = {Sampler().sample(row, [_seq(0, SamplingParams(temperature=1.0, seed=1),
                                               outputs=[0] * n)])[0] for n in range(40)}
    assert len(by_seed) > 3 and len(by_position) > 3


def test_unseeded_rows_follow_the_engine_seed():
    logits = _logits(6)
    seqs = [_seq(i, SamplingParams(temperature=1.0)) for i in range(6)]
    assert Sampler(5).sample(logits, seqs) == Sampler(5).sample(logits, seqs)
    draws = {tuple(Sampler(s).sample(logits, seqs)) for s in range(5)}
    assert len(draws) == 5


def _chi2_quantile_999(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile (within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor, num_draws: int) -> float:
    support = probs > 0
    expected = num_draws * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,top_k,top_p,min_p,seeded", [
    (1.0, 0, 1.0, 0.0, True),
    (0.7, 4, 1.0, 0.0, True),
    (1.3, 0, 0.8, 0.0, True),
    (1.0, 0, 1.0, 0.15, True),
    (0.8, 6, 0.9, 0.05, True),
    (1.0, 0, 0.8, 0.0, False),
], ids=["plain", "top_k", "top_p", "min_p", "all", "top_p_unseeded"])
def test_draws_follow_the_filtered_distribution(temperature, top_k, top_p, min_p, seeded):
    num_draws = 20000
    row = torch.log(torch.tensor(PROBS))
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             seed=i if seeded else None) for i in range(num_draws)]
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    ids = torch.tensor(Sampler(3).sample(row.expand(num_draws, -1), seqs))
    counts = torch.bincount(ids, minlength=len(PROBS)).double()
    expected = filtered_probs(row / temperature, top_k, top_p, min_p).double()
    assert counts[expected == 0].sum() == 0
    df = int((expected > 0).sum()) - 1
    assert _chi2(counts, expected, num_draws) < _chi2_quantile_999(df)
    # The bound is tight enough to reject the distribution without the filters and temperature.
    unfiltered = torch.tensor(PROBS, dtype=torch.double)
    wrong = unfiltered if expected.count_nonzero() < len(PROBS) or temperature != 1 else \
        torch.softmax(row.double() / 1.1, dim=0)
    assert _chi2(counts, wrong, num_draws) > _chi2_quantile_999(int((wrong > 0).sum()) - 1)


def test_filters_never_pick_a_filtered_token():
    logits = torch.log(torch.tensor(PROBS)).expand(500, -1)
    # With p = PROBS: mass before the third token is 0.5, and 0.6 * 0.3 = 0.18 > 0.15.
    cases = [(dict(top_k=2), {0, 1}), (dict(top_p=0.45), {0, 1}), (dict(min_p=0.6), {0, 1}),
             (dict(top_k=3, top_p=0.25), {0})]
    for kwargs, allowed in cases:
        seqs = [_seq(i, SamplingParams(temperature=1.0, seed=i, **kwargs)) for i in range(500)]
        assert set(Sampler().sample(logits, seqs)) == allowed, kwargs


def _penalty_batch() -> list[Sequence]:
    return [
        _seq(0, SamplingParams(temperature=0, repetition_penalty=1.5), [1, 2, 9], [4, 4]),
        _seq(1, SamplingParams(temperature=0)),
        _seq(2, SamplingParams(temperature=0.8, seed=3, presence_penalty=0.7,
                               frequency_penalty=0.3), [7, 7, 8], [8, 3, 3, 3]),
        _seq(3, SamplingParams(temperature=0, repetition_penalty=0.8, presence_penalty=-0.5,
                               frequency_penalty=1.2), [5], [5, 6, 6]),
    ]


def test_penalties_match_the_spec_as_tokens_accumulate():
    sampler, seqs = Sampler(), _penalty_batch()
    for step in range(6):
        logits = _logits(len(seqs), seed=step)
        t = SamplingTensors.build(seqs, VOCAB, logits.device, 0, sampler.penalties)
        expected = torch.stack([apply_penalties(row, seq) if i != 1 else row
                                for i, (row, seq) in enumerate(zip(logits, seqs, strict=True))])
        torch.testing.assert_close(sampler.penalties.apply(logits, t.penalties), expected)
        for seq, token_id in zip(seqs, sampler.sample(logits, seqs), strict=True):
            seq.token_ids.append(token_id)
    # Only sequences that use a penalty hold counts.
    assert sorted(sampler.penalties.slots) == [0, 2, 3]
    slot = sampler.penalties.slots[2]
    assert sampler.penalties.output_counts[slot].tolist() == \
        torch.bincount(torch.tensor(seqs[2].output_token_ids), minlength=VOCAB).tolist()
    assert sampler.penalties.prompt_seen[slot].nonzero().flatten().tolist() == [7, 8]


def test_penalties_change_the_right_tokens():
    # Token 3 leads but was output twice; token 4 is next and unseen.
    row = torch.full((1, VOCAB), -5.0)
    row[0, 3], row[0, 4], row[0, 1] = 2.0, 1.5, 1.8
    base = dict(temperature=0)
    assert Sampler().sample(row, [_seq(0, SamplingParams(**base), [1], [3, 3])]) == [3]
    # frequency 0.3 * 2 pushes 3 below 1.8 (token 1, in the prompt: no output penalty).
    params = SamplingParams(frequency_penalty=0.3, **base)
    assert Sampler().sample(row, [_seq(0, params, [1], [3, 3])]) == [1]
    # repetition 2 halves both 3 (output) and 1 (prompt): 4 wins.
    params = SamplingParams(repetition_penalty=2.0, **base)
    assert Sampler().sample(row, [_seq(0, params, [1], [3, 3])]) == [4]


def test_penalty_counts_are_rebuilt_when_an_id_is_dropped_and_freed_on_release():
    sampler = Sampler()
    seq = _seq(0, SamplingParams(temperature=1.0, seed=1, frequency_penalty=1.0), [1], [2])
    for _ in range(3):  # sampled but never appended
        sampler.sample(_logits(1), [seq])
    sampler.penalties.prepare([seq], VOCAB, torch.device("cpu"))
    slot = sampler.penalties.slots[0]
    assert sampler.penalties.output_counts[slot].nonzero().flatten().tolist() == [2]
    sampler.release(seq)
    assert not sampler.penalties.slots
    other = _seq(1, SamplingParams(temperature=0, presence_penalty=1.0), [1], [])
    sampler.sample(_logits(1), [other])
    assert sampler.penalties.slots == {1: slot}
    assert int(sampler.penalties.output_counts[slot].sum()) == 1


def test_logprobs_are_those_of_the_raw_row():
    logits = _logits(4)
    seqs = [_seq(0, SamplingParams(temperature=0.9, seed=5, logprobs=3, repetition_penalty=1.4,
                                   logits_processors=[LogitBias({7: 30.0})]), outputs=[7]),
            _seq(1, SamplingParams(temperature=0)),
            _seq(2, SamplingParams(temperature=0, logprobs=0)),
            _seq(3, SamplingParams(temperature=1.0, top_p=0.5, logprobs=5, seed=2))]
    ids = Sampler().sample(logits, seqs)
    assert ids[0] == 7  # the bias decided it; the logprobs ignore the bias
    for seq, row, token_id in zip(seqs, logits, ids, strict=True):
        k = seq.params.logprobs
        if k is None:
            assert seq.logprobs == []
            continue
        (entry,) = seq.logprobs
        logp = torch.log_softmax(row, dim=-1)
        top = set(logp.topk(k).indices.tolist())
        assert set(entry) == top | {token_id}
        for token, value in entry.items():
            assert value == pytest.approx(float(logp[token]), abs=1e-6)


def test_a_raising_processor_fails_only_its_row():
    logits = _logits(3)
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.8, seed=2),
              SamplingParams(temperature=0, repetition_penalty=1.2)]
    seqs = [_seq(i, p) for i, p in enumerate(params)]
    sampler = Sampler()
    clean = sampler.sample(logits, seqs)
    assert sampler.errors == {}
    seqs[1].params.logits_processors.append(_boom)
    ids = sampler.sample(logits, seqs)
    assert sampler.errors == {1: "RuntimeError: boom"}
    assert ids[0] == clean[0] and ids[2] == clean[2]


def test_tool_processors_on_rows():
    ids = ToolTokenIds(think_end=10, call_start=11, call_end=12, arg_key=13)
    forced = ForcedToolCall(ids, [0, 1], [[7, 8]], starts_in_reasoning=True)
    row = torch.zeros(VOCAB)
    assert forced([2, 10, 11, 7, 8], row).isfinite().nonzero().flatten().tolist() == [12, 13]
    assert not forced([2], row)[[0, 1]].isfinite().any() and forced([2], row)[2] == 0
    assert LogitBias({3: 2.5, 4: -1.0})([], row)[[2, 3, 4]].tolist() == [0.0, 2.5, -1.0]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    return Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", background_loop=False,
                  check_integrity=True)


def test_a_raising_processor_ends_only_its_sequence(engine):
    def fail_late(output_ids, logits):
        if len(output_ids) == 2:
            raise RuntimeError("processor failed")
        return logits

    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=4, ignore_eos=True,
                            frequency_penalty=0.5)
    alone = [engine.generate(p, s)[0].token_ids for p, s in (("one", greedy), ("two", seeded))]
    deltas = {}
    failing = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                             logits_processors=[fail_late])
    for prompt, params in (("bad", failing), ("one", greedy), ("two", seeded)):
        ids = engine.tokenizer.encode(prompt)
        rid = engine.add_request(ids, params, lambda d: deltas.setdefault(d.request_id, [])
                                 .append(d))
        deltas[rid] = []
    while not all(d and d[-1].finish_reason for d in deltas.values()):
        engine.step()
    bad, one, two = deltas.values()
    assert bad[-1].finish_reason == "error" and "processor failed" in bad[-1].error
    assert sum(len(d.token_ids) for d in bad) == 2
    assert [t for d in one for t in d.token_ids] == alone[0]
    assert [t for d in two for t in d.token_ids] == alone[1]
    assert engine.cache.num_free_pages == engine.cache.plan.num_pages
    assert not engine.sampler.penalties.slots


@pytest.mark.gpu
def test_gpu_sampling_has_no_host_sync_and_matches_the_cpu():
    logits = _logits(6, vocab_size=1000)
    ids = ToolTokenIds(think_end=10, call_start=11, call_end=12, arg_key=13)

    def batch() -> list[Sequence]:
        return [
            _seq(0, SamplingParams(temperature=0)),
            _seq(1, SamplingParams(temperature=0.9, top_p=0.9, seed=11, logprobs=3)),
            _seq(2, SamplingParams(temperature=1.1, top_k=40, min_p=0.02, seed=12)),
            _seq(3, SamplingParams(temperature=0.7, seed=13, repetition_penalty=1.3,
                                   presence_penalty=0.5, frequency_penalty=0.2), [5, 6], [6, 9]),
            _seq(4, SamplingParams(temperature=0, logprobs=0,
                                   logits_processors=[LogitBias({3: 4.0, 8: -2.0})])),
            _seq(5, SamplingParams(temperature=0.8, seed=14, logits_processors=[
                ForcedToolCall(ids, [0, 1], [[7, 8]], starts_in_reasoning=True)]), outputs=[2, 10]),
        ]

    cpu_seqs, gpu_seqs = batch(), batch()
    expected = Sampler().sample(logits, cpu_seqs)
    assert expected[5] == ids.call_start
    gpu, logits_gpu = Sampler(), logits.cuda()
    torch.cuda.synchronize()
    # The first call creates the penalty counts and the processors' copies; the second, whose
    # ids were not appended, recounts the penalised sequence from its tokens.
    for _ in range(2):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = gpu.sample_on_device(logits_gpu, gpu_seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert out.copy_done is not None and out.packed_cpu.is_pinned()
        out.copy_done.synchronize()
        assert out.packed_cpu[:6].tolist() == expected
    assert gpu.sample(logits_gpu, gpu_seqs) == expected
    for cpu_seq, gpu_seq in zip(cpu_seqs, gpu_seqs, strict=True):
        for cpu_entry, gpu_entry in zip(cpu_seq.logprobs, gpu_seq.logprobs, strict=True):
            assert cpu_entry.keys() == gpu_entry.keys()
            assert all(abs(cpu_entry[k] - gpu_entry[k]) < 1e-4 for k in cpu_entry)
