"""Triton indexer selection against indexer/ref.py, as sets of slots per query (tie order may
differ). Interpreter on CPU, compiled with CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.indexer import (
    decode_select_plan,
    indexer_select_ref,
    select_plan,
    triton_impl,
)
from glmflash.kernels.indexer.triton_impl import (
    ONE_QUERY,
    ScoreLaunch,
    indexer_select,
    score_pools,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


PAGE = 16


def _batch(new, prefix, heads, dim, kpool, dtype, seed=42):
    """Sequence b is in page-table row b + 1 (row 0 unused); pages scrambled; pool keys random."""
    gen = torch.Generator().manual_seed(seed)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    pages_per_seq = -(-max(p + n for n, p in zip(new, prefix, strict=True)) // PAGE)
    rows = len(new) + 1
    table = torch.randperm(rows * pages_per_seq, generator=gen).view(rows, pages_per_seq)
    q = torch.randn(cu[-1], heads, dim, generator=gen).to(dtype)
    weights = torch.randn(cu[-1], heads, generator=gen)
    pool_keys = torch.randn(rows * pages_per_seq * PAGE // kpool, dim, generator=gen).to(dtype)
    tensors = [t.to(DEVICE) for t in (q, weights, pool_keys, table.to(torch.int32))]
    plan = select_plan(cu, list(prefix), list(range(1, rows)), kpool, torch.device(DEVICE))
    return tensors, plan


def _check(new, prefix, *, heads=4, dim=32, kpool=4, topk=16, tail=True, dtype=torch.float32,
           score=ONE_QUERY, decode=triton_impl.DECODE_SCORE):
    (q, w, pk, table), plan = _batch(new, prefix, heads, dim, kpool, dtype)
    args = (q, w, pk, table, plan)
    kw = dict(page_size=PAGE, topk=topk, kpool=kpool, select_tail=tail)
    want = indexer_select_ref(*args, **kw)
    got = indexer_select(*args, **kw, score=score, decode=decode)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)
    return want


CASES = {
    "decode1": ([1], [40]),
    "decode3": ([1, 1, 1], [3, 100, 17]),
    "prefill_then_decode": ([30, 1], [0, 60]),
    "empty_seq": ([9, 0, 5], [7, 2, 50]),
    "no_complete_pool": ([3, 2], [0, 0]),
    "pool_edge": ([1, 1], [63, 64]),
}


@pytest.mark.parametrize("new,prefix", CASES.values(), ids=CASES.keys())
def test_indexer_select_matches_ref(new, prefix, poisoned_empty):
    _check(new, prefix)


# Several queries per scoring program: tiles inside one sequence, tiles across a sequence
# boundary (scored query by query), a last tile with fewer queries, and decodes; one or several
# pool blocks per program (16 pools a block: 50 pools in the odd chunk).
TILED = {"2q": ScoreLaunch(2), "4q": ScoreLaunch(4), "4q_3_blocks": ScoreLaunch(4, 3, 2, 16),
         "2q_2_blocks": ScoreLaunch(2, 2, 1, 16), "1q_3_blocks": ScoreLaunch(1, 3, 2, 16)}


@pytest.mark.parametrize("score", TILED.values(), ids=TILED.keys())
@pytest.mark.parametrize("new,prefix", [([30, 1], [0, 60]), ([9, 0, 5], [7, 2, 50]),
                                        ([1, 1, 1], [3, 100, 17]), ([13], [200])],
                         ids=["prefill_then_decode", "empty_seq", "decode3", "odd_chunk"])
def test_indexer_select_several_queries_per_program(new, prefix, score, poisoned_empty):
    _check(new, prefix, score=score)
    # Odd heads and width (masked rows and columns of the product): the same candidate counts,
    # and scores equal up to the order of the sum over heads.
    (q, w, pk, table), plan = _batch(new, prefix, 3, 24, 4, torch.float32)
    n = q.shape[0]
    got = {}
    for launch in (ONE_QUERY, score):
        scores = torch.full((n, max(plan.max_pools, 1)), float("nan"), device=DEVICE)
        lengths = torch.full((n,), -1, dtype=torch.int32, device=DEVICE)
        score_pools(q, w, pk, table, plan, scores, lengths, 0, n, PAGE, 4, launch)
        got[launch] = scores, lengths
    (one, one_len), (tiled, tiled_len) = got[ONE_QUERY], got[score]
    assert torch.equal(one_len, tiled_len)
    cand = torch.arange(one.shape[1], device=DEVICE)[None, :] < one_len[:, None]
    assert torch.allclose(one[cand], tiled[cand], rtol=1e-6, atol=1e-6)
    assert torch.isnan(tiled[~cand]).all(), "a score past a row's candidates was written"


def test_indexer_select_tiles_only_chunks(monkeypatch):
    """By default a plan with a chunk of at least CHUNK_SCORE.queries queries scores that many
    per program; a batch of decodes (or only shorter chunks) takes the decode rule's launch
    (here, with the floor out of reach, one query per program)."""
    seen = []
    score = triton_impl.score_pools
    monkeypatch.setattr(triton_impl, "num_sms", lambda device: 4)  # the interpreter's count
    monkeypatch.setattr(triton_impl, "score_pools",
                        lambda *a, **k: seen.append(a[-1]) or score(*a, **k))
    one_only = triton_impl.DecodeScoreRule(min_programs_per_sm=1 << 20)
    tiled = triton_impl.CHUNK_SCORE
    for new, prefix, want in (([1, 1, 1], [3, 100, 17], ONE_QUERY), ([30, 1], [0, 60], tiled),
                              ([tiled.queries - 1, 1], [40, 9], ONE_QUERY)):
        # 8 heads: a pool whose heads all score below zero scores exactly 0, and with 4 heads
        # such ties decide the last place here (their order is free).
        (q, w, pk, table), plan = _batch(new, prefix, 8, 32, 4, torch.float32)
        got = triton_impl.indexer_select(q, w, pk, table, plan, page_size=PAGE, topk=16,
                                         kpool=4, select_tail=True, decode=one_only)
        want_slots = indexer_select_ref(q, w, pk, table, plan, page_size=PAGE, topk=16,
                                        kpool=4, select_tail=True)
        assert torch.equal(got.sort(dim=1).values, want_slots.sort(dim=1).values)
        assert seen.pop() == want, (new, prefix)


@pytest.mark.parametrize(("new", "prefix"), [([1, 1, 1], [3, 100, 17]), ([30, 1], [0, 60])],
                         ids=["decodes", "chunk"])
def test_head_weights_scaled_in_the_kernel(new, prefix):
    """16-bit head weights with `weight_scale` give the selection of the same weights cast to
    fp32 and scaled first (the model's H^-1/2), in both scoring launches; the reference too."""
    (q, w, pk, table), plan = _batch(new, prefix, 8, 32, 4, torch.float32)
    w16 = (w * 8).bfloat16()
    kwargs = dict(page_size=PAGE, topk=16, kpool=4, select_tail=True)
    got = triton_impl.indexer_select(q, w16, pk, table, plan, weight_scale=0.125, **kwargs)
    want = triton_impl.indexer_select(q, w16.float() * 0.125, pk, table, plan, **kwargs)
    assert torch.equal(got, want)
    ref = indexer_select_ref(q, w16, pk, table, plan, weight_scale=0.125, **kwargs)
    assert torch.equal(ref, indexer_select_ref(q, w16.float() * 0.125, pk, table, plan,
                                               **kwargs))


def test_decode_rule_tiles_only_when_every_sm_keeps_programs(monkeypatch):
    """Decodes take the first of the rule's tiled launches whose grid leaves
    `min_programs_per_sm` programs per SM (counted in whole pool-block groups), one query per
    program when none does; either way the selection is the reference's."""
    wide, narrow = ScoreLaunch(1, 3, 2, 16), ScoreLaunch(1, 2, 1, 16)
    rule = triton_impl.DecodeScoreRule((wide, narrow), min_programs_per_sm=2)
    assert rule.pick(8, 48, 4) == wide  # 8 queries x 1 group of 3 blocks = 8 programs
    assert rule.pick(3, 16 * 6, 4) == narrow  # 6 blocks: 3 x 2 groups of 3 < 8, 3 x 3 of 2
    assert rule.pick(3, 48, 4) == ONE_QUERY  # 3 x 1 group of 3, 3 x 2 groups of 2
    assert rule.pick(2, 16 * 3 * 3 + 1, 4) == wide  # 10 blocks: 4 groups of 3 each
    assert rule.pick(2, 16 * 3 * 3, 4) == narrow  # 9 blocks: 3 groups of 3, 5 of 2
    seen = []
    score = triton_impl.score_pools
    monkeypatch.setattr(triton_impl, "num_sms", lambda device: 4)  # the interpreter's count
    monkeypatch.setattr(triton_impl, "score_pools",
                        lambda *a, **k: seen.append(a[-1]) or score(*a, **k))
    # Four decodes, the longest of 400 tokens (100 pools, 7 blocks of 16: 3 groups of 3, 4 of
    # 2): a grid of 12 or 16 programs over 4 SMs (the interpreter's count, also on a GPU).
    for floor, want in ((3, wide), (4, narrow), (5, ONE_QUERY)):
        _check([1, 1, 1, 1], [150, 399, 260, 201], score=triton_impl.CHUNK_SCORE,
               decode=triton_impl.DecodeScoreRule((wide, narrow), min_programs_per_sm=floor))
        assert seen.pop() == want


def test_decode_rule_picks_the_measured_shapes_on_132_sms():
    """DECODE_SCORE at the H200's sizes picks what indexer/README.md's table measured fastest:
    (context x sequences) -> launch."""
    pick = triton_impl.DECODE_SCORE.pick
    kpool = 4
    tiled = ScoreLaunch(1, 8, 3, 128)
    picks = {(131072, 1): ONE_QUERY, (131072, 4): ONE_QUERY, (131072, 8): tiled,
             (131072, 32): tiled, (1048576, 1): tiled, (1048576, 4): tiled,
             (1048576, 32): tiled}
    for (context, sequences), want in picks.items():
        assert pick(sequences, context // kpool, 132) == want, (context, sequences)


def test_indexer_select_follows_page_table():
    """A decode whose context spans several scrambled pages selects slots of its own pages."""
    (q, w, pk, table), plan = _batch([1], [100], 4, 32, 4, torch.float32)
    got = _check([1], [100], topk=16)
    own = {int(p) * PAGE + o for p in table[1].tolist() for o in range(PAGE)}
    # Four whole pools plus the query's own incomplete pool (position 100 of 101 tokens).
    assert set(got[got >= 0].tolist()) <= own and (got >= 0).sum() == 16 + 101 % 4


def test_indexer_select_no_tail_kpool16():
    _check([9, 0, 5], [7, 2, 50], tail=False)
    _check([5, 1], [0, 70], kpool=16, topk=32)


def test_indexer_select_bf16():
    _check([20, 1], [10, 90], dtype=torch.bfloat16)


def _decode_check(prefix, max_pools, **kw):
    """Decodes scored at a fixed width `max_pools` (as a CUDA graph captures them) against the
    reference at the same width."""
    (q, w, pk, table), plan = _batch([1] * len(prefix), prefix, 4, 32, 4, torch.float32)
    plan = decode_select_plan(plan.rows, plan.positions, 4, max_pools)
    kw = dict(page_size=PAGE, topk=16, kpool=4, select_tail=True) | kw
    want = indexer_select_ref(q, w, pk, table, plan, **kw)
    got = indexer_select(q, w, pk, table, plan, **kw)
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


def test_indexer_select_decode_width_beyond_every_row():
    # 1, 25 and 4 complete pools scored at the width of the longest page-table row (28 pools).
    _decode_check([3, 100, 17], 28)


@pytest.mark.gpu
def test_indexer_select_graph_replay_gpu():
    """Captured once at a wide width; replayed after the positions (on the device) move."""
    (q, w, pk, table), plan = _batch([1, 1, 1], [6000, 2100, 5000], 32, 128, 4, torch.float32)
    rows, positions = plan.rows, plan.positions.clone()
    kw = dict(page_size=PAGE, topk=2048, kpool=4, select_tail=True)

    def select():
        return indexer_select(q, w, pk, table, decode_select_plan(rows, positions, 4, 1500),
                              **kw)

    select()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = select()
    for new in ([5000, 100, 4096], [6000, 2100, 5000], [0, 2, 3]):
        positions.copy_(torch.tensor(new))
        graph.replay()
        want = indexer_select_ref(q, w, pk, table, decode_select_plan(rows, positions, 4, 1500),
                                  **kw)
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.gpu
@pytest.mark.parametrize("score", [ONE_QUERY, ScoreLaunch(4), ScoreLaunch(8),
                                   triton_impl.CHUNK_SCORE, ScoreLaunch(4, 16, 3),
                                   ScoreLaunch(1, 16, 2), ScoreLaunch(1, 8, 3, 128)],
                         ids=["one", "4q", "8q", "default", "4q_16_blocks", "1q_16_blocks",
                              "1q_8_blocks_of_128"])
def test_indexer_select_release_shape_gpu(score):
    # 32 heads x 128, kpool 4, top-2048: a 6000-token context makes the selection sparse.
    _check([1, 1, 300], [6000, 2100, 5000], heads=32, dim=128, topk=2048, dtype=torch.float32,
           score=score)
