"""Launch-shape sweeps of the decode-sized GPU kernels (prints only; pick defaults from these).

    PYTHONPATH=. python bench/sweeps.py
        [--ops kda,kda_prefill,kda_profile,topk,indexer_prefill,indexer_decode,mla,fp8,fp8row,
               fp8codes,fp8codes_grid,fp8paths,fp8rules,moe,moe_aux]

`kda_profile`: each kernel's GPU time in fla's prefill and the candidates' (first length);
`moe`: fused MoE prefill at 8192 tokens by parts: both sorts, the GEMMs (bench/fused_moe.py);
`moe_aux`: its launches around the GEMMs (sort, quantiser and gather, weighted sum) by shape;
`fp8rules`: FP8 linear at 16 rows, the streaming grid and the per-shape rules over it;
`fp8codes`: FP8 linear at 2-32 rows, the fp16-codes weight-only form against the streaming one;
`fp8codes_grid`: the fp16-codes form at 16 rows over columns, waves, warps and stages;
`fp8paths`: FP8 linear at 16-128 rows by every path, where the dispatch's row thresholds lie;
`indexer_prefill`: the indexer's scoring of a prefill chunk at long context, by launch shape
(`indexer.triton_impl.ScoreLaunch`: queries and pool blocks per program, stages);
`indexer_decode`: the same for decodes (one query per sequence) at 128K and 1M.

Every time is the median of CUDA-graph replays (bench/kernels.py `graph_ms`); kda_prefill
(bench/kda_sweep.py) times whole prefills by events, next to fla's.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bf16_peak_tflops, copy_bandwidth, graph_ms, rotated  # noqa: E402
from bench.kernels import (  # noqa: E402
    FP8_SHAPES,
    INDEXER_SHAPE,
    D,
    _kda_inputs,
    indexer_decode_plan,
    indexer_inputs,
    indexer_keys,
)


def sweep_kda_decode() -> None:
    for b in (1, 8, 32):
        _sweep_kda_decode_batch(b)


def _sweep_kda_decode_batch(b: int) -> None:
    from glmflash.kernels.kda import triton_impl as ti

    q, k, v, g, beta, state = _kda_inputs(b, b)
    cu, slots, fresh = list(range(b + 1)), list(range(b)), [False] * b
    moved = 2 * state.numel() * 4
    for bv, warps in itertools.product((8, 16, 32, 64), (1, 2, 4)):
        config = ti.KdaConfig(decode_narrow=(bv, warps), decode_wide=(bv, warps))
        ms = graph_ms(lambda c=config: ti.kda(q, k, v, g, beta, state, cu, slots, fresh,
                                              config=c))
        print(f"kda decode b={b} BV={bv} warps={warps}: {ms * 1e3:.1f} us "
              f"{moved / ms / 1e6:.0f} GB/s", flush=True)


def sweep_sparse_mla() -> None:
    """Sparse MLA candidates next to the default and the roofline (bench/sparse_mla_sweep.py)."""
    from bench.sparse_mla_sweep import sweep

    print(sweep(), flush=True)


def sweep_fp8(w8a8: bool) -> None:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8

    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        _sweep_fp8_shape(k, n, wq, ws, w8a8)


def _sweep_fp8_shape(k: int, n: int, wq: torch.Tensor, ws: torch.Tensor, w8a8: bool) -> None:
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    wqs = rotated(wq)
    for m in (1, 16):
        x = torch.randn(m, k, device="cuda").bfloat16()
        best = None
        for bn, waves, stages, warps in itertools.product((32, 64, 128), (2.0, 4.0, 8.0),
                                                          (2, 4), (4, 8)):
            # the product path at M = 1 too (fp8row sweeps the FMA path)
            config = dataclasses.replace(ti.DEFAULT_CONFIG, wdq_fma_rows=0, wdq_block_n=bn,
                                         wdq_waves=waves, wdq_stages=stages, wdq_warps=warps)
            ms = graph_ms([lambda x=x, w=w, c=config: ti.fp8_linear_weight_only(x, w, ws, 128, c)
                           for w in wqs])
            best = min(best or (ms, ()), (ms, (bn, waves, stages, warps)))
            print(f"fp8 wdq {k}->{n} M={m} BN={bn} waves={waves} stages={stages} "
                  f"warps={warps}: {ms * 1e3:.1f} us {n * k / ms / 1e6:.0f} GB/s", flush=True)
        print(f"fp8 wdq {k}->{n} M={m} BEST {best[1]}: {best[0] * 1e3:.1f} us", flush=True)
    if not w8a8:
        return
    x = torch.randn(2048, k, device="cuda").bfloat16()
    for tile in ((128, 128, 8, 4), (128, 128, 4, 4), (64, 128, 4, 4), (128, 256, 8, 3),
                 (128, 64, 4, 4), (64, 256, 8, 3)):
        config = dataclasses.replace(ti.DEFAULT_CONFIG, w8a8_tile=tile)
        ms = graph_ms(lambda c=config: ti.fp8_linear_w8a8(x, wq, ws, 128, c))
        print(f"fp8 w8a8 {k}->{n} M=2048 tile={tile}: {ms * 1e3:.1f} us "
              f"{2 * 2048 * n * k / ms / 1e9:.0f} TFLOP/s", flush=True)


def sweep_fp8_one_row() -> None:
    """Decode of one token: tensor-core products vs the FMA path by columns and waves, and
    `fp8_linear` as configured (the one-row rule on its GPU), against per-tensor `_scaled_mm`
    at 16 rows (weights rotated past L2)."""
    from bench.kernels import _scaled_mm
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        wqs = rotated(wq)
        x = torch.randn(1, k, device="cuda").bfloat16()
        ref = graph_ms([_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs])  # 16 rows
        rule = graph_ms([lambda x=x, w=w, ws=ws: ti.fp8_linear(x, w, ws) for w in wqs])
        print(f"fp8 one row {k}->{n}: per-tensor _scaled_mm {ref * 1e3:.1f} us, fp8_linear "
              f"{rule * 1e3:.1f} us ({ref / rule:.2f})", flush=True)
        for fma, bn, waves in itertools.product((0, 1), (32, 64), (2.0, 4.0, 8.0)):
            config = dataclasses.replace(ti.DEFAULT_CONFIG, wdq_fma_rows=fma, wdq_block_n=bn,
                                         wdq_fma_block_n=bn, wdq_waves=waves,
                                         one_row_rule=None)
            ms = graph_ms([lambda x=x, w=w, ws=ws, c=config:
                           ti.fp8_linear_weight_only(x, w, ws, 128, c) for w in wqs])
            print(f"fp8 one row {k}->{n} fma={fma} BN={bn} waves={waves}: "
                  f"{ms * 1e3:.1f} us {n * k / ms / 1e6:.0f} GB/s", flush=True)


def _fp8_linear_ms(x: torch.Tensor, weights: list[torch.Tensor], scale: torch.Tensor,
                   config=None) -> float:
    """Graph ms of `fp8_linear` over the rotated weight copies (`config`: its default)."""
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    return graph_ms([lambda w=w: ti.fp8_linear(x, w, scale, config=config) for w in weights])


def sweep_fp8_codes(rows=(2, 4, 8, 16, 32)) -> None:
    """A few rows: the weight-only kernel on fp16 codes by columns and waves against the W8A8
    streaming form (its H200 rule) and per-tensor `_scaled_mm` (at 16 rows, cuBLAS's minimum;
    weights rotated past L2)."""
    from bench.kernels import _scaled_mm
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    stream = dataclasses.replace(ti.DEFAULT_CONFIG, codes_max_rows=0)
    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        wqs = rotated(wq)
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = graph_ms([_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs])
            w8a8 = _fp8_linear_ms(x, wqs, ws, stream)
            cells = []
            for bn, waves in itertools.product((64, 128), (2.0, 4.0, 8.0)):
                config = dataclasses.replace(ti.DEFAULT_CONFIG, codes_max_rows=m,
                                             wdq_block_n=bn, wdq_waves=waves, codes_rule=None)
                ms = _fp8_linear_ms(x, wqs, ws, config)
                cells.append(f"{bn}/{waves:g} {ms * 1e3:.1f}")
            rule = _fp8_linear_ms(x, wqs, ws)
            print(f"fp8 codes {k}->{n} M={m}: per-tensor _scaled_mm {ref * 1e3:.1f} us, W8A8 "
                  f"stream {w8a8 * 1e3:.1f}, fp8_linear {rule * 1e3:.1f}, codes by "
                  f"columns/waves: {', '.join(cells)}", flush=True)
        del wqs


def sweep_fp8_paths(rows=(16, 24, 32, 48, 64, 96, 128)) -> None:
    """Where `fp8_linear` changes paths (`codes_max_rows`, `gemm_min_rows`): at each row count
    and release shape, every path that can serve it - the weight-only kernel on fp16 codes, the
    W8A8 streaming form (its H200 rule), cuBLASLt's block-scaled GEMM, the Triton W8A8 GEMM -
    beside per-tensor `_scaled_mm` and the default dispatch (weights rotated past L2)."""
    from glmflash.kernels.fp8_gemm import quantize_block_fp8

    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        wqs = rotated(wq)
        for m in rows:
            x = torch.randn(m, k, device="cuda").bfloat16()
            paths = _fp8_paths(x, wqs, ws, m)
            cells = ", ".join(f"{name} {graph_ms(fns) * 1e3:.1f}" for name, fns in paths.items())
            print(f"fp8 paths {k}->{n} M={m} (us): {cells}", flush=True)
        del wqs


def _fp8_paths(x: torch.Tensor, wqs: list[torch.Tensor], ws: torch.Tensor, m: int) -> dict:
    """Per path of `sweep_fp8_paths`, its calls over the rotated weight copies `wqs`."""
    from functools import partial

    from bench.kernels import _scaled_mm
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    codes = dataclasses.replace(ti.DEFAULT_CONFIG, codes_max_rows=m)
    stream = dataclasses.replace(ti.DEFAULT_CONFIG, codes_max_rows=0, gemm_min_rows=m + 1)
    return {"per-tensor _scaled_mm": [_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs],
            "fp8_linear": [partial(ti.fp8_linear, x, w, ws) for w in wqs],
            "codes": [partial(ti.fp8_linear, x, w, ws, config=codes) for w in wqs],
            "stream": [partial(ti.fp8_linear, x, w, ws, config=stream) for w in wqs],
            "cuBLAS blockwise": [partial(ti.fp8_linear_scaled_mm, x, w, ws, 128) for w in wqs],
            "Triton W8A8": [partial(ti.fp8_linear_w8a8, x, w, ws, 128) for w in wqs]}


# fp16-codes launch shapes at 16 rows: block_n x waves x (warps, stages).
CODES_GRID = list(itertools.product((32, 64, 128), (1.0, 2.0, 4.0), ((4, 4), (4, 6), (8, 4))))


def sweep_fp8_codes_grid(m: int = 16) -> None:
    """The fp16-codes weight-only form at `m` rows over `CODES_GRID` (columns, programs per SM,
    warps and stages), per release shape, against per-tensor `_scaled_mm` and the rule's
    `fp8_linear`; the best three shapes printed per release shape."""
    from bench.kernels import _scaled_mm
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        wqs = rotated(wq)
        x = torch.randn(m, k, device="cuda").bfloat16()
        ref = graph_ms([_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs])
        rule = _fp8_linear_ms(x, wqs, ws)
        timed = []
        for bn, waves, (warps, stages) in CODES_GRID:
            config = dataclasses.replace(ti.DEFAULT_CONFIG, codes_max_rows=m, wdq_block_n=bn,
                                         wdq_waves=waves, wdq_warps=warps, wdq_stages=stages,
                                         codes_rule=None)
            timed.append((_fp8_linear_ms(x, wqs, ws, config),
                          f"{bn}/{waves:g}/{warps}w/{stages}s"))
        best = ", ".join(f"{name} {ms * 1e3:.1f}" for ms, name in sorted(timed)[:3])
        print(f"fp8 codes grid {k}->{n} M={m}: per-tensor _scaled_mm {ref * 1e3:.1f} us, "
              f"fp8_linear {rule * 1e3:.1f} ({ref / rule:.2f}), best: {best} "
              f"({ref / sorted(timed)[0][0]:.2f})", flush=True)
        del wqs


# Weight-streaming launch shapes at 16 rows: (block_n, waves, min split blocks, warps, stages).
STREAM_GRID = [(64, 4.0, 2, 4, 4), (64, 2.0, 2, 4, 6), (64, 4.0, 4, 4, 4), (64, 2.0, 4, 4, 6),
               (64, 1.0, 2, 4, 6), (64, 8.0, 2, 4, 4), (64, 4.0, 1, 4, 4), (128, 2.0, 2, 8, 4)]


def _full(shape: tuple) -> tuple:
    """A grid or rule shape with every StreamConfig field (the rest at their defaults)."""
    from glmflash.kernels.fp8_gemm.triton_stream import StreamConfig

    return dataclasses.astuple(StreamConfig(*shape))


# Candidate rules over that grid: (min_k, max_k, max_n, shape) entries, first match wins, the
# default shape otherwise.
BIG = 1 << 30
STREAM_RULES = {
    "default": (),
    "waves 2, 6 stages everywhere": ((0, BIG, BIG, (64, 2.0, 2, 4, 6)),),
    "by N: up to 4096 split more, above waves 2": (
        (0, BIG, 4096, (64, 4.0, 4, 4, 4)), (0, BIG, BIG, (64, 2.0, 2, 4, 6))),
    "by N: up to 4096 default, above one wave": (
        (0, BIG, 4096, (64, 4.0, 2, 4, 4)), (0, BIG, BIG, (64, 1.0, 2, 4, 6))),
    "short K: fewer splits; long K: waves 2": (
        (0, 2048, BIG, (64, 2.0, 4, 4, 6)), (16384, BIG, BIG, (64, 2.0, 2, 4, 6)),
        (0, BIG, 4096, (64, 4.0, 4, 4, 4)), (0, BIG, BIG, (64, 2.0, 2, 4, 6))),
}


def sweep_fp8_rules(m: int = 16) -> None:
    """At `m` rows: every grid shape at the five release shapes against per-tensor
    `_scaled_mm` (weights rotated past L2), then each rule's pick per shape and its worst
    ratio (goal: >= 0.8 on all five)."""
    from bench.kernels import _scaled_mm
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm.triton_stream import StreamConfig, fp8_linear_stream

    base, times = {}, {}
    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        x = torch.randn(m, k, device="cuda").bfloat16()
        wqs = rotated(wq)
        base[k, n] = graph_ms([_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs])
        for shape in map(_full, STREAM_GRID):
            cfg = StreamConfig(*shape)
            times[k, n, shape] = graph_ms(
                [lambda x=x, w=w, ws=ws, c=cfg: fp8_linear_stream(x, w, ws, 128, c)
                 for w in wqs])
            print(f"fp8 stream {k}->{n} M={m} {shape}: {times[k, n, shape] * 1e3:.1f} us "
                  f"({base[k, n] / times[k, n, shape]:.2f} of per-tensor "
                  f"{base[k, n] * 1e3:.1f} us)", flush=True)
        del wqs
    for name, entries in list(STREAM_RULES.items()) + [("H200 rule (the default)", _h200_rule()),
                                                       ("per-shape best", "best")]:
        cells = []
        for k, n in FP8_SHAPES:
            shape = (min(map(_full, STREAM_GRID), key=lambda s: times[k, n, s])
                     if entries == "best" else _full(_rule_pick(entries, n, k)))
            cells.append(f"{k}->{n} {base[k, n] / times[k, n, shape]:.2f}")
        worst = min(float(c.split()[-1]) for c in cells)
        print(f"fp8 M={m} rule [{name}]: {', '.join(cells)}; worst {worst:.2f}", flush=True)


def _h200_rule() -> tuple:
    """fp8_linear's default rule as sweep entries (its default as a last, catch-all entry)."""
    from glmflash.kernels.fp8_gemm.triton_stream import H200_STREAM_RULE as rule

    return tuple((a, b, c, dataclasses.astuple(cfg)) for a, b, c, cfg in rule.entries) + (
        (0, BIG, BIG, dataclasses.astuple(rule.default)),)


def _rule_pick(entries, n: int, k: int) -> tuple:
    for min_k, max_k, max_n, shape in entries:
        if min_k <= k <= max_k and n <= max_n:
            return shape
    return STREAM_GRID[0]


# (rows, pooled keys per row): one query at 128K context and 32 queries at 1M (kpool 4).
# (rows, width): one decode at 128K and 32 at 1M (the issue's), and sizes between.
TOPK_SHAPES = ((1, 32768), (32, 32768), (1, 262144), (4, 262144), (32, 262144))


# Score distributions for the top-k: normal scores (candidates after the first byte: a few
# percent), and every score in [1, 2) (one first byte: every key is a candidate, the worst case).
TOPK_SCORES = {"normal": lambda r, w: torch.randn(r, w, device="cuda"),
               "one binade": lambda r, w: torch.rand(r, w, device="cuda") + 1.0}


def sweep_topk(k: int = 512) -> None:
    """The radix top-k (indexer/topk_triton.py) at each launch shape against torch.topk."""
    from glmflash.kernels.indexer.topk_triton import DEFAULT_CONFIG, topk_indices

    grid = [DEFAULT_CONFIG] + [
        dataclasses.replace(DEFAULT_CONFIG, **change)
        for change in (dict(programs_per_sm=8), dict(programs_per_sm=2),
                       dict(few_programs_warps=4), dict(num_warps=8), dict(list_divisor=2))]
    for (rows, width), (kind, make) in itertools.product(TOPK_SHAPES, TOPK_SCORES.items()):
        scores = make(rows, width)
        lengths = torch.full((rows,), width, dtype=torch.int32, device="cuda")
        want = scores.topk(k, dim=1).values.sort(1).values
        torch_us = graph_ms(lambda s=scores: s.topk(k, dim=1)) * 1e3
        name = f"topk rows={rows} width={width} {kind}"
        print(f"{name}: torch.topk {torch_us:.1f} us", flush=True)
        for c in grid:
            got = topk_indices(scores, lengths, k, config=c).long()
            ok = torch.equal(scores.gather(1, got).sort(1).values, want)
            us = graph_ms(lambda c=c, s=scores, n=lengths: topk_indices(s, n, k, config=c)) * 1e3
            print(f"{name} per_sm={c.programs_per_sm} warps={c.num_warps}/"
                  f"{c.few_programs_warps} list_divisor={c.list_divisor}: "
                  f"{us:.1f} us{'' if ok else ' WRONG SET'}", flush=True)


# (context tokens, queries of one sequence at its end): a prefill chunk at long context.
INDEXER_PREFILL_SHAPES = ((131072, 512), (1048576, 512))


# Scoring launches for a prefill chunk: (queries, pool blocks per program, stages[, pools a
# block[, warps]]); first the one-query kernel, then the default, then other tilings.
INDEXER_CHUNK_GRID = [(1, 1, 1), (4, 16, 2), (4, 1, 1), (4, 4, 2), (4, 8, 2), (4, 16, 3),
                      (4, 32, 3), (8, 8, 2), (2, 16, 3), (4, 8, 2, 128)]
# The FP8 keys' pass (with or without e4m3 queries): the one-query kernel, the default and
# 128-pool blocks.
INDEXER_CHUNK_GRID_FP8 = [(1, 1, 1), (4, 16, 2), (4, 8, 2, 128), (4, 8, 3, 128)]


def sweep_indexer_prefill(shapes=None, formats=None) -> None:
    """The scoring kernel over a chunk of one sequence's queries at each launch shape, against
    the bf16 tensor peak (the chunk's products) of the same run; bf16 keys, then FP8 rows,
    then FP8 rows and e4m3 queries."""
    grids = {"bf16": INDEXER_CHUNK_GRID, "fp8": INDEXER_CHUNK_GRID_FP8,
             "fp8, e4m3 queries": INDEXER_CHUNK_GRID_FP8}
    _each_key_format(_indexer_prefill_case, _only(grids, formats),
                     _only(INDEXER_PREFILL_SHAPES, shapes), bf16_peak_tflops())


def _only(items, wanted):
    """`items` (a tuple of shapes or a dict of key formats) cut to `wanted`, or whole."""
    if wanted is None:
        return items
    if isinstance(items, dict):
        return {k: v for k, v in items.items() if k in wanted}
    return tuple(x for x in items if x in wanted)


def _each_key_format(case, grids: dict, shapes, measure: float) -> None:
    """`case(*shape, measure, keys, grid)` for each pooled-key format (bench/kernels.py
    INDEXER_KEY_FORMATS) with its grid of launch shapes, at each shape."""
    for keys, grid in grids.items():
        for shape in shapes:
            case(*shape, measure, keys, grid)
            torch.cuda.empty_cache()


def _indexer_prefill_case(ctx_len: int, chunk: int, peak: float, keys: str,
                          grid: list[tuple]) -> None:
    from glmflash.kernels.indexer import select_plan
    from glmflash.kernels.indexer.triton_impl import ScoreLaunch, score_pools

    heads, dim, kpool, page = INDEXER_SHAPE
    plan = select_plan([0, chunk], [ctx_len - chunk], [0], kpool, torch.device("cuda"))
    pool_keys, table_, q, w = indexer_inputs(chunk, 1, ctx_len)
    pool_keys, fp8_queries = indexer_keys(pool_keys, keys)
    lengths = torch.empty(chunk, dtype=torch.int32, device="cuda")
    pools = sum((p + 1) // kpool for p in range(ctx_len - chunk, ctx_len))
    flops = 2 * heads * dim * pools
    base, first = None, None
    for shape in grid:
        launch = ScoreLaunch(*shape)
        scores = torch.full((chunk, plan.max_pools), float("nan"), device="cuda")
        us = graph_ms(lambda s=scores, c=launch: score_pools(
            q, w, pool_keys, table_, plan, s, lengths, 0, chunk, page, kpool, c,
            fp8_queries=fp8_queries)) * 1e3
        first = scores if first is None else first
        cand = ~torch.isnan(first)
        same = torch.allclose(scores[cand], first[cand], rtol=1e-3, atol=1e-3)
        base = base or us
        print(f"indexer prefill ctx={ctx_len} chunk={chunk} {keys} "
              f"{shape}: {us:.0f} us "
              f"({base / us:.2f}x of one query), {flops / us / 1e6:.0f} TFLOP/s "
              f"(bf16 peak {peak:.0f}), same scores {same}", flush=True)


# Scoring launches for decodes: (queries, pool blocks per program, stages[, pools a block[,
# warps]]); one query and one block per program first, then tiled shapes.
INDEXER_DECODE_GRID = [(1, 1, 1), (1, 4, 2), (1, 8, 2), (1, 16, 2), (1, 16, 3), (1, 16, 4),
                       (1, 8, 2, 128), (1, 8, 3, 128), (1, 8, 4, 128), (1, 8, 3, 128, 8),
                       (1, 4, 3, 256, 8)]
# e4m3 queries beside FP8 keys (`fp8_queries`): the one-query kernel first, then the tiled forms.
INDEXER_DECODE_GRID_FP8Q = [(1, 1, 1), (1, 8, 3, 128), (1, 8, 4, 128), (1, 16, 3),
                            (1, 4, 3, 256), (1, 2, 3, 512)]
# (context, sequences): one query at 128K and 32 sequences at 1M (the decode shapes),
# and the sizes between, where DECODE_SCORE's program floor decides.
INDEXER_DECODE_SHAPES = ((131072, 1), (131072, 8), (131072, 32), (1048576, 1), (1048576, 4),
                         (1048576, 32))


def sweep_indexer_decode(shapes=None, formats=None) -> None:
    """The scoring of decodes (one query per sequence) at each launch shape, against reading
    the pooled keys once at the copy bandwidth of the same run; bf16 keys, then FP8 rows,
    then FP8 rows and e4m3 queries."""
    grids = {"bf16": INDEXER_DECODE_GRID, "fp8": INDEXER_DECODE_GRID,
             "fp8, e4m3 queries": INDEXER_DECODE_GRID_FP8Q}
    _each_key_format(_indexer_decode_case, _only(grids, formats),
                     _only(INDEXER_DECODE_SHAPES, shapes), copy_bandwidth())


def _indexer_decode_case(ctx_len: int, b: int, copy_gbs: float, keys: str,
                         grid: list[tuple]) -> None:
    from glmflash.kernels.indexer.triton_impl import DECODE_SCORE, ScoreLaunch, score_pools
    from glmflash.kernels.triton_utils import num_sms

    _, _, kpool, page = INDEXER_SHAPE
    pools = ctx_len // kpool
    pool_keys, table_, q, w = indexer_inputs(b, b, ctx_len)
    pool_keys, fp8_queries = indexer_keys(pool_keys, keys)
    lengths = torch.empty(b, dtype=torch.int32, device="cuda")
    plan = indexer_decode_plan(ctx_len, b)
    floor_us = pool_keys.numel() * pool_keys.element_size() / copy_gbs / 1e3
    picked = DECODE_SCORE.pick(b, pools, num_sms(q.device))
    print(f"indexer decode scoring ctx={ctx_len} queries={b} {keys}: DECODE_SCORE picks "
          f"{picked}", flush=True)
    first = None
    for shape in grid:
        scores = torch.full((b, pools), float("nan"), device="cuda")
        launch = ScoreLaunch(*shape)
        us = graph_ms(lambda s=scores, c=launch: score_pools(
            q, w, pool_keys, table_, plan, s, lengths, 0, b, page, kpool, c,
            fp8_queries=fp8_queries)) * 1e3
        first = scores if first is None else first
        same = torch.allclose(scores, first, rtol=1e-3, atol=1e-3)
        print(f"indexer decode scoring ctx={ctx_len} queries={b} {keys} {shape}: {us:.0f} us "
              f"(key read at copy bandwidth {floor_us:.0f} us), same scores {same}", flush=True)


def sweep_moe_aux(num_tokens: int = 8192) -> None:
    """The fused MoE prefill's launches around its GEMMs (288 experts, top-8, hidden 4096):
    the sort by chunk and rank width (2048 and 8192 tokens, uniform and skewed routing), then
    at `num_tokens` with uniform routing the Gluon form's quantiser and row gather, and the
    weighted sum by columns per program and warps, against the copy bandwidth."""
    from bench.fused_moe import routing

    copy_gbs = copy_bandwidth()
    _sweep_moe_sort()
    ids, weights = routing(num_tokens, False)
    _time_moe_gather(ids, copy_gbs)
    _sweep_moe_sum(ids, weights, copy_gbs)


def _sweep_moe_sort() -> None:
    from bench.fused_moe import EXPERTS, routing
    from glmflash.kernels.fused_moe.triton_impl import sort_pairs
    from glmflash.kernels.fused_moe.triton_sort import SortConfig

    for tokens, skewed in ((2048, False), (8192, False), (8192, True)):
        ids = routing(tokens, skewed)[0]
        for chunk, sub in itertools.product((256, 512, 1024), (64, 128)):
            config = SortConfig(chunk=chunk, sub=sub)
            us = graph_ms(lambda c=config, i=ids: sort_pairs(i, EXPERTS, 128, c)) * 1e3
            print(f"moe sort {tokens} tokens{' skewed' if skewed else ''} chunk={chunk} "
                  f"sub={sub}: {us:.1f} us", flush=True)


def _time_moe_gather(ids: torch.Tensor, copy_gbs: float) -> None:
    from bench.fused_moe import EXPERTS, HIDDEN, TOP_K
    from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations
    from glmflash.kernels.fused_moe.gluon_w8a8 import gather_rows
    from glmflash.kernels.fused_moe.triton_impl import sort_pairs

    x = torch.randn(ids.shape[0], HIDDEN, device="cuda").bfloat16()
    pairs, blocks = sort_pairs(ids, EXPERTS, 128)
    xq, xs = quantize_activations(x, torch.float8_e4m3fn, 128)
    rows = int((blocks >= 0).sum()) * 128
    quantize_us = graph_ms(lambda: quantize_activations(x, torch.float8_e4m3fn, 128)) * 1e3
    gather_us = graph_ms(lambda: gather_rows(xq, xs, pairs, blocks, TOP_K)) * 1e3
    # Both read x once and write the sorted rows (codes and scales) once at best.
    moved = x.numel() * 2 + rows * HIDDEN * (1 + 4 / 128)
    print(f"moe quantiser {quantize_us:.1f} us + gather {gather_us:.1f} us "
          f"(floor of the two fused {moved / copy_gbs / 1e3:.1f})", flush=True)


def _sweep_moe_sum(ids: torch.Tensor, weights: torch.Tensor, copy_gbs: float) -> None:
    import triton

    from bench.fused_moe import EXPERTS, HIDDEN, TOP_K
    from glmflash.kernels.fused_moe.triton_impl import fused_moe_sum_kernel

    num_tokens = ids.shape[0]
    y = torch.randn(num_tokens * TOP_K, HIDDEN, device="cuda").bfloat16()
    out = torch.empty(num_tokens, HIDDEN, device="cuda").bfloat16()
    moved = (y.numel() + out.numel()) * 2
    for bd, warps in itertools.product((512, 1024, 2048, 4096), (2, 4, 8)):
        us = graph_ms(lambda b=bd, w=warps: fused_moe_sum_kernel[
            (num_tokens, triton.cdiv(HIDDEN, b))](
            y, ids, weights, out, EXPERTS, HIDDEN, y.stride(0), out.stride(0), TOP_K=TOP_K,
            BD=b, num_warps=w)) * 1e3
        print(f"moe sum BD={bd} warps={warps}: {us:.1f} us "
              f"(floor {moved / copy_gbs / 1e3:.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="kda,mla,fp8")
    parser.add_argument("--no-w8a8", action="store_true", help="skip the M=2048 tiles")
    parser.add_argument("--kda-tokens", default="32768,131072",
                        help="kda_prefill lengths, comma-separated")
    parser.add_argument("--kda-candidates", default=None,
                        help="kda_prefill candidates (bench/kda_sweep.py CANDIDATES), "
                        "comma-separated, or all; default kda_sweep.SWEEP_DEFAULT")
    parser.add_argument("--indexer-shapes", default=None,
                        help="indexer sweeps' shapes only, e.g. 131072x1,1048576x32 "
                        "(context x sequences, or context x chunk for prefill)")
    parser.add_argument("--key-formats", default=None,
                        help="indexer sweeps' key formats only, ';'-separated: "
                        "bf16;fp8;fp8, e4m3 queries")
    args = parser.parse_args()
    ops = args.ops.split(",")
    assert D == 128
    if "kda" in ops:
        sweep_kda_decode()
    if "kda_prefill" in ops:
        from bench.kda_sweep import sweep_kda

        names = args.kda_candidates.split(",") if args.kda_candidates else None
        sweep_kda([int(n) for n in args.kda_tokens.split(",")], names)
    if "kda_profile" in ops:
        from bench.kda_sweep import SWEEP_DEFAULT, profile_kda

        names = args.kda_candidates.split(",") if args.kda_candidates else list(SWEEP_DEFAULT)
        profile_kda(int(args.kda_tokens.split(",")[0]), names)
    if "topk" in ops:
        sweep_topk()
    shapes = ([tuple(int(n) for n in s.split("x")) for s in args.indexer_shapes.split(",")]
              if args.indexer_shapes else None)
    formats = args.key_formats.split(";") if args.key_formats else None
    if "indexer_prefill" in ops:
        sweep_indexer_prefill(shapes, formats)
    if "indexer_decode" in ops:
        sweep_indexer_decode(shapes, formats)
    if "mla" in ops:
        sweep_sparse_mla()
    if "fp8" in ops:
        sweep_fp8(not args.no_w8a8)
    if "fp8row" in ops:
        sweep_fp8_one_row()
    if "fp8codes" in ops:
        sweep_fp8_codes()
    if "fp8paths" in ops:
        sweep_fp8_paths()
    if "fp8codes_grid" in ops:
        sweep_fp8_codes_grid()
    if "fp8rules" in ops:
        sweep_fp8_rules()
    if "moe_aux" in ops:
        sweep_moe_aux()
    if "moe" in ops:
        from bench.fused_moe import parts_table

        print("\nFused MoE prefill by parts, 288 x 4096 x 2048, top-8, CUDA-graph timed\n\n"
              + parts_table(), flush=True)


if __name__ == "__main__":
    main()
