"""GPU kernel benchmarks: Triton KDA, sparse MLA, indexer and FP8 linear against their baselines.

    PYTHONPATH=. python bench/kernels.py [--ops kda,mla,indexer,fp8,fp8_small] [--out FILE]

Each op prints one markdown table and appends it to bench/RESULTS.md (or to --out, for runs on a
remote machine whose tree does not come back). Bandwidth figures are compared with a
device-to-device copy measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    append_results,
    bench_ms,
    bf16_peak_tflops,
    copy_bandwidth,
    device_description,
    git_commit,
    graph_ms,
    rotated,
    table,
)
from bench.sparse_mla import bench_sparse_mla  # noqa: E402

H, D = 64, 128  # KDA heads x head dim (release)


def _kda_inputs(num_tokens: int, num_seqs: int = 1):
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (rnd(num_tokens, H, D).bfloat16() for _ in range(3))
    g = -5 * torch.sigmoid(rnd(num_tokens, H, D))
    beta = torch.sigmoid(rnd(num_tokens, H)).bfloat16()
    state = rnd(num_seqs, H, D, D) * 0.1
    return q, k, v, g, beta, state


def _fla():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda  # noqa: F401
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
        return chunk_kda, fused_recurrent_kda_fwd
    except Exception as e:  # noqa: BLE001 - report any reason fla is unusable
        print(f"fla-core unavailable: {e!r}")
        return None, None


def bench_kda_decode(batches: list[int], copy_gbs: float) -> str:
    _, fla_recurrent = _fla()
    rows = []
    for b in batches:
        row = _kda_decode_row(b, copy_gbs, fla_recurrent)
        rows.append(row)
        print(row, flush=True)
    return table(["batch", "triton us (eager)", "triton us (graph)", "GB/s (state r+w, graph)",
                  "% of copy BW (goal 60%)", "fla fused_recurrent us (graph)", "fla GB/s"], rows)


def _kda_decode_row(b: int, copy_gbs: float, fla_recurrent) -> list:
    from glmflash.kernels.kda import triton_impl as ti

    q, k, v, g, beta, state = _kda_inputs(b, b)
    cu, slots, fresh = list(range(b + 1)), list(range(b)), [False] * b
    eager = bench_ms(lambda: ti.kda(q, k, v, g, beta, state, cu, slots, fresh), rep=100)
    states = rotated(state)
    ms = graph_ms([lambda s=s: ti.kda(q, k, v, g, beta, s, cu, slots, fresh)
                   for s in states])
    moved = 2 * state.numel() * 4 + 4 * q.numel() * 2 + g.numel() * 4
    gbs = moved / ms / 1e6
    row = [b, f"{eager * 1e3:.1f}", f"{ms * 1e3:.1f}", f"{gbs:.0f}",
           f"{100 * gbs / copy_gbs:.0f}%"]
    if fla_recurrent is not None:
        cu_t = torch.tensor(cu, device="cuda")
        fla_ms = graph_ms([lambda s=s: fla_recurrent(
            q[None], k[None], v[None], g[None], beta[None], initial_state=s,
            scale=D ** -0.5, inplace_final_state=True, cu_seqlens=cu_t,
            use_qk_l2norm_in_kernel=True) for s in states])
        row += [f"{fla_ms * 1e3:.1f}", f"{moved / fla_ms / 1e6:.0f}"]
    return row


INDEXER_SHAPES = [(131072, 1), (1048576, 32)]  # (context tokens, decoding sequences)


def bench_indexer(shapes: list[tuple[int, int]], copy_gbs: float) -> str:
    """Per shape, the pooled keys in bf16 (the reference's), as FP8 rows
    (`--index-key-dtype fp8`), and as FP8 rows scored with e4m3 queries (`fp8_queries`)."""
    rows = []
    for ctx_len, b in shapes:
        for keys in INDEXER_KEY_FORMATS:
            rows.append(_indexer_row(ctx_len, b, copy_gbs, keys))
            print(rows[-1], flush=True)
            torch.cuda.empty_cache()
    return table(["context", "queries", "keys", "select us (goal 40 / 400)", "radix top-k us",
                  "torch.topk us", "pool-key read at copy BW us", "torch ref us",
                  "same set as ref", "share of the bf16 keys' selection"], rows)


# Indexer release shapes: heads, head dim, tokens per pool, page size; tokens selected.
INDEXER_SHAPE = (32, 128, 4, 64)
INDEXER_TOPK = 2048
# Pooled-key formats the indexer benches time: name -> (FP8 rows, e4m3 queries beside them).
INDEXER_KEY_FORMATS = {"bf16": (False, False), "fp8": (True, False),
                       "fp8, e4m3 queries": (True, True)}


def indexer_keys(pool_keys: torch.Tensor, keys: str) -> tuple[torch.Tensor, bool]:
    """bf16 pooled keys in the format `keys` (of INDEXER_KEY_FORMATS), and whether the
    scoring takes e4m3 queries (`fp8_queries`)."""
    from glmflash.kernels.indexer import key_format

    fp8, fp8_queries = INDEXER_KEY_FORMATS[keys]
    return (key_format.quantize(pool_keys) if fp8 else pool_keys), fp8_queries


def indexer_inputs(queries: int, sequences: int, ctx_len: int) -> tuple:
    """Random pooled keys of `sequences` caches of `ctx_len` tokens (page table rows in order)
    and `queries` queries: (pool_keys, page_table, q, weights)."""
    heads, dim, kpool, page = INDEXER_SHAPE
    pool_keys = torch.randn(sequences * ctx_len // kpool, dim, device="cuda").bfloat16()
    table = torch.arange(sequences * ctx_len // page, device="cuda",
                         dtype=torch.int32).view(sequences, -1)
    q = torch.randn(queries, heads, dim, device="cuda").bfloat16()
    w = torch.randn(queries, heads, device="cuda") * heads ** -0.5
    return pool_keys, table, q, w


def indexer_decode_plan(ctx_len: int, b: int):
    """The select plan of `b` decodes, sequence i at the last position of its cache i."""
    from glmflash.kernels.indexer import decode_select_plan

    kpool = INDEXER_SHAPE[2]
    return decode_select_plan(torch.arange(b, device="cuda"),
                              torch.full((b,), ctx_len - 1, device="cuda"), kpool,
                              ctx_len // kpool)


def _indexer_row(ctx_len: int, b: int, copy_gbs: float, keys: str) -> list:
    """Decodes of `b` sequences of `ctx_len` tokens each, as a CUDA graph runs them, over
    pooled keys in the format `keys` (INDEXER_KEY_FORMATS)."""
    from glmflash.kernels.indexer import indexer_select_ref, key_format
    from glmflash.kernels.indexer import triton_impl as ti
    from glmflash.kernels.indexer.topk_triton import topk_indices

    _, _, kpool, page = INDEXER_SHAPE
    topk = INDEXER_TOPK
    pools = ctx_len // kpool
    plain_keys, table_, q, w = indexer_inputs(b, b, ctx_len)
    pool_keys, fp8_queries = indexer_keys(plain_keys, keys)
    fp8 = key_format.is_fp8(pool_keys)
    args = (q, w, pool_keys, table_, indexer_decode_plan(ctx_len, b))
    kw = dict(page_size=page, topk=topk, kpool=kpool, select_tail=True,
              fp8_queries=fp8_queries)
    ms = graph_ms(lambda: ti.indexer_select(*args, **kw))
    scores = torch.randn(b, pools, device="cuda")
    lengths = torch.full((b,), pools, dtype=torch.int32, device="cuda")
    radix_ms = graph_ms(lambda: topk_indices(scores, lengths, topk // kpool))
    torch_ms = graph_ms(lambda: scores.topk(topk // kpool, dim=1))
    floor_ms = pool_keys.numel() * pool_keys.element_size() / copy_gbs / 1e6
    row = [ctx_len, b, keys, f"{ms * 1e3:.0f}", f"{radix_ms * 1e3:.0f}",
           f"{torch_ms * 1e3:.0f}", f"{floor_ms * 1e3:.0f}"]
    got = ti.indexer_select(*args, **kw)
    if b * ctx_len <= 131072:
        ref_ms = bench_ms(lambda: indexer_select_ref(*args, **kw), rep=50)
        same = torch.equal(got.sort(1).values, indexer_select_ref(*args, **kw).sort(1).values)
        row += [f"{ref_ms * 1e3:.0f}", str(same)]
    else:
        row += ["-", "-"]
    plain = ti.indexer_select(q, w, plain_keys, table_, args[4],
                              **dict(kw, fp8_queries=False)) if fp8 else got
    row.append(f"{_selection_share(got, plain):.3f}" if fp8 else "-")
    return row


def _selection_share(got: torch.Tensor, want: torch.Tensor) -> float:
    """Share of the slots `want` selects that `got` also selects (rows alike, -1 padding)."""
    hits = torch.stack([torch.isin(w_row, g_row) for w_row, g_row in zip(want, got,
                                                                          strict=True)])
    real = want >= 0
    return float((hits & real).sum() / real.sum().clamp_min(1))


FP8_SHAPES = [(4096, 1536), (1536, 16384), (16384, 4096), (4096, 4096), (4096, 24576)]


def _scaled_mm(xq: torch.Tensor, wq: torch.Tensor):
    one = torch.ones((), device="cuda")
    m = xq.shape[0]
    pad = -m % 16
    if pad:
        xq = torch.cat([xq, xq.new_zeros(pad, xq.shape[1])])
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def bench_fp8(ms_list: list[int]) -> str:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8

    rows = []
    for k, n in FP8_SHAPES:
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
        for m in ms_list:
            rows.append(_fp8_row(k, n, m, wq, ws))
            print(rows[-1], flush=True)
    return table(["shape", "M", "fp8_linear us", "rate", "weight-only us", "triton w8a8 us",
                  "blockwise _scaled_mm us", "per-tensor _scaled_mm us", "per-tensor rate",
                  "unit", "per-tensor / fp8_linear (goal 0.8)"], rows)


def _fp8_row(k: int, n: int, m: int, wq: torch.Tensor, ws: torch.Tensor) -> list:
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    x = torch.randn(m, k, device="cuda").bfloat16()
    xq = x.to(torch.float8_e4m3fn)
    # Decode rows stream the weight: rotate copies so that replays read it from HBM, not L2.
    wqs = rotated(wq) if m <= 16 else [wq]
    base = graph_ms([_scaled_mm(xq, w) for w in wqs])
    auto = graph_ms([lambda w=w: ti.fp8_linear(x, w, ws) for w in wqs])
    wo = graph_ms([lambda w=w: ti.fp8_linear_weight_only(x, w, ws, 128) for w in wqs])
    w8 = graph_ms([lambda w=w: ti.fp8_linear_w8a8(x, w, ws, 128) for w in wqs])
    blockwise = graph_ms([lambda w=w: ti.fp8_linear_scaled_mm(x, w, ws, 128) for w in wqs])
    unit = "GB/s" if m <= 16 else "TFLOP/s"

    def rate(t):
        return f"{n * k / t / 1e6:.0f}" if m <= 16 else f"{2 * m * n * k / t / 1e9:.0f}"

    return [f"{k}->{n}", m, f"{auto * 1e3:.1f}", rate(auto), f"{wo * 1e3:.1f}",
            f"{w8 * 1e3:.1f}", f"{blockwise * 1e3:.1f}", f"{base * 1e3:.1f}", rate(base), unit,
            f"{base / auto:.2f}"]


# Weight-streaming launch shapes the small-row sweep times (the default first).
STREAM_SWEEP = [(64, 4.0, 2, 4, 4), (64, 8.0, 2, 4, 4), (64, 4.0, 4, 4, 4), (64, 2.0, 2, 4, 6),
                (128, 4.0, 2, 4, 4), (128, 4.0, 2, 8, 4), (32, 4.0, 2, 4, 4)]


def bench_fp8_small(m: int, sweep: bool) -> str:
    """M rows at the five release shapes: fp8_linear (the weight-streaming W8A8 form) against
    per-tensor `_scaled_mm`, the weight-only form and blockwise `_scaled_mm`; with `sweep`, the
    streaming launch shapes (block_n, waves, min split blocks, warps, stages), fastest named."""
    rows = []
    for k, n in FP8_SHAPES:
        rows.append(_fp8_small_row(k, n, m, sweep))
        print(rows[-1], flush=True)
    return table(["shape", "M", "fp8_linear us", "GB/s", "per-tensor _scaled_mm us", "GB/s",
                  "per-tensor / fp8_linear (goal 0.8)", "weight-only us",
                  "blockwise _scaled_mm us", "fastest stream shape us (n, waves, split, w, s)"],
                 rows)


def _fp8_small_row(k: int, n: int, m: int, sweep: bool) -> list:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti
    from glmflash.kernels.fp8_gemm.triton_stream import StreamConfig, fp8_linear_stream

    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
    x = torch.randn(m, k, device="cuda").bfloat16()
    wqs = rotated(wq)
    base = graph_ms([_scaled_mm(x.to(torch.float8_e4m3fn), w) for w in wqs])
    auto = graph_ms([lambda w=w: ti.fp8_linear(x, w, ws) for w in wqs])
    wo = graph_ms([lambda w=w: ti.fp8_linear_weight_only(x, w, ws, 128) for w in wqs])
    blockwise = graph_ms([lambda w=w: ti.fp8_linear_scaled_mm(x, w, ws, 128) for w in wqs])
    best = "-"
    if sweep:
        times = {}
        for shape in STREAM_SWEEP:
            cfg = StreamConfig(*shape)
            times[shape] = graph_ms([lambda w=w, c=cfg: fp8_linear_stream(x, w, ws, 128, c)
                                     for w in wqs])
            print(f"sweep {k}->{n} M={m} {shape}: {times[shape] * 1e3:.1f} us", flush=True)
        fastest = min(times, key=times.get)
        best = f"{times[fastest] * 1e3:.1f} {fastest} ({base / times[fastest]:.2f})"
    return [f"{k}->{n}", m, f"{auto * 1e3:.1f}", f"{n * k / auto / 1e6:.0f}",
            f"{base * 1e3:.1f}", f"{n * k / base / 1e6:.0f}", f"{base / auto:.2f}",
            f"{wo * 1e3:.1f}", f"{blockwise * 1e3:.1f}", best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="kda,kda_decode,mla,indexer,fp8")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the sections here instead of appending to bench/RESULTS.md")
    parser.add_argument("--commit", default=None, help="commit to record (default: git HEAD)")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    parser.add_argument("--sweep", action="store_true", help="launch-shape sweeps first")
    parser.add_argument("--kda-tokens", default=None,
                        help="KDA prefill lengths, comma-separated (default 4096,32768,131072)")
    args = parser.parse_args()
    ops = args.ops.split(",")
    copy_gbs = copy_bandwidth()
    print(f"HBM copy: {copy_gbs:.0f} GB/s", flush=True)
    commit = args.commit or git_commit()

    def emit(title: str, body: str) -> None:
        print(f"\n## {title}\n\n{body}", flush=True)
        if args.out is None:
            append_results(title, body)
            return
        stamp = datetime.date.today().isoformat()
        with args.out.open("a") as f:
            f.write(f"\n## {title}\n\n{stamp} · {device_description()} · commit {commit}\n\n"
                    f"{body}\n")

    if "fp8_small" in ops:
        emit("FP8 block-scaled linear at 16 rows: weight-streaming W8A8 vs torch._scaled_mm "
             "(per-tensor scales), CUDA-graph timed, weights rotated past L2 (bench/kernels.py)",
             bench_fp8_small(16, args.sweep))
    if "fp8" in ops:
        emit("FP8 block-scaled linear vs torch._scaled_mm (per-tensor scales), CUDA-graph timed, "
             "decode weights rotated past L2 (bench/kernels.py)",
             bench_fp8([1, 16, 2048]))
    if "mla" in ops:
        peak = bf16_peak_tflops()
        print(f"bf16 matmul peak: {peak:.0f} TFLOP/s", flush=True)
        emit(f"Sparse MLA decode and prefill, 64 heads, latent 512, 2051 slots of a 128K cache, "
             f"CUDA-graph timed, decode slot sets rotated past L2 (bench/sparse_mla.py; copy "
             f"{copy_gbs:.0f} GB/s, bf16 peak {peak:.0f} TFLOP/s)",
             bench_sparse_mla(copy_gbs, peak))
    if "indexer" in ops:
        emit(f"Indexer select (decode), 32 heads x 128, kpool 4, top-2048, CUDA-graph timed "
             f"(bench/kernels.py; copy {copy_gbs:.0f} GB/s)",
             bench_indexer(INDEXER_SHAPES, copy_gbs))
    if "kda" in ops:
        from bench.kda_prefill import bench_kda_prefill, check_kda_accuracy
        from bench.kda_sweep import sweep_kda

        sizes = [4096, 32768] if args.quick else [4096, 32768, 131072]
        if args.kda_tokens:
            sizes = [int(n) for n in args.kda_tokens.split(",")]
        emit("KDA prefill: accuracy vs the fp32 reference (bench/kernels.py)",
             check_kda_accuracy([n for n in sizes if n <= 32768]))
        if args.sweep:
            sweep_kda([n for n in sizes if n >= 32768] or sizes)
        emit("KDA prefill, 64 heads x 128, bf16, one sequence (bench/kernels.py)",
             bench_kda_prefill(sizes))
    if "kda_decode" in ops:
        emit(f"KDA decode step, 64 heads x 128, CUDA-graph timed, states rotated past L2 "
             f"(bench/kernels.py; copy {copy_gbs:.0f} GB/s)",
             bench_kda_decode([1, 8, 32], copy_gbs))

if __name__ == "__main__":
    main()
