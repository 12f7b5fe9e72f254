"""Routed experts on the GPU at release shapes: the fused Triton MoE against the per-expert loop
and against a dense block-FP8 GEMM of equal FLOPs (cuBLASLt's block-scaled `torch._scaled_mm`).

288 experts, hidden 4096, width 2048, top-8, FP8 weights with 128x128 scales, bf16 activations;
routing uniform (random distinct experts per token) or skewed (a Zipf-like preference: a few
experts take most pairs). Decode sizes report the expert bytes touched per call at the achieved
rate against the HBM copy bandwidth of the same run (goal: >= 60% at 1-8 tokens); prefill sizes
report TFLOP/s against the dense GEMM (goal: >= 0.7x at 8192 tokens). CUDA-graph timed.

    python bench/fused_moe.py [--tokens 1 8 32 2048 8192] [--no-loop]
    python bench/fused_moe.py --forms 8192 [--sweep]   # prefill: W8A8 form vs bf16 form
    python bench/sweeps.py --ops moe                     # prefill parts at 8192
    python bench/fused_moe.py --tokens 1 8 --decode-sweep  # decode launch shapes

`--forms`: at each given size (uniform routing) the W8A8 prefill form and the dequantising bf16
form against the dense GEMM, and the sort alone; `--sweep` also times a few W8A8 launch shapes
and names the fastest.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import copy_bandwidth, graph_ms, table  # noqa: E402
from glmflash.kernels.fp8_gemm import quantize_block_fp8  # noqa: E402
from glmflash.kernels.fp8_gemm.triton_impl import (  # noqa: E402
    fp8_linear_scaled_mm,
    quantize_activations,
)
from glmflash.kernels.fused_moe.triton_impl import (  # noqa: E402
    DECODE_CONFIG,
    DEFAULT_DISPATCH,
    PREFILL_CONFIG,
    FusedMoeConfig,
    SortConfig,
    W8A8MoeConfig,
    fused_moe,
    sort_pairs,
)
from glmflash.kernels.fused_moe.triton_w8a8 import w8a8_experts  # noqa: E402

EXPERTS, HIDDEN, INTER, TOP_K, LIMIT = 288, 4096, 2048, 8, 7.0
SORT_ONE = SortConfig(scan_min_pairs=1 << 62)  # always the one-launch sort
SORT_SCAN = SortConfig(scan_min_pairs=0)  # always histogram + scatter


def expert_weights() -> list[torch.Tensor]:
    """gate, gate scales, up, up scales, down, down scales (random FP8 codes, one copy)."""
    out = []
    for n, k in ((INTER, HIDDEN), (INTER, HIDDEN), (HIDDEN, INTER)):
        w, s = quantize_block_fp8(torch.randn(16, n, k, device="cuda") * 0.05)
        # 288 experts from 16 distinct ones (memory and set-up time); each has its own bytes.
        out += [w.repeat(EXPERTS // 16, 1, 1), s.repeat(EXPERTS // 16, 1, 1)]
    return out


def routing(num_tokens: int, skewed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    if skewed:
        prefer = 1.0 / torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.float32)
        scores = torch.log(prefer)[None] - torch.log(-torch.log(
            torch.rand(num_tokens, EXPERTS, device="cuda", generator=gen)))
    else:
        scores = torch.rand(num_tokens, EXPERTS, device="cuda", generator=gen)
    ids = scores.topk(TOP_K, dim=1).indices
    return ids, torch.rand(num_tokens, TOP_K, device="cuda", generator=gen)


def loop_moe(x, ids, weights, w) -> torch.Tensor:
    """The per-expert loop the fused kernel replaced: dequantise each hit expert, three GEMMs."""
    from glmflash.kernels.fp8_gemm import dequantize_block_fp8

    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        rows, slot = torch.where(ids == e)
        gate, up, down = (dequantize_block_fp8(w[2 * i][e], w[2 * i + 1][e]).to(x.dtype)
                          for i in range(3))
        h = x[rows]
        act = torch.nn.functional.silu((h @ gate.t()).clamp(max=LIMIT)) * \
            (h @ up.t()).clamp(-LIMIT, LIMIT)
        out.index_add_(0, rows, (act @ down.t()) * weights[rows, slot, None].to(x.dtype))
    return out


def row(num_tokens: int, skewed: bool, w: list[torch.Tensor], copy_gbs: float,
        with_loop: bool) -> list:
    x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = routing(num_tokens, skewed)
    fused_ms = graph_ms(lambda: fused_moe(x, ids, weights, *w, limit=LIMIT))
    hit = ids.unique().numel()
    expert_bytes = hit * 3 * INTER * HIDDEN  # FP8 codes; scales are 1/16384 of that
    flops = 2 * num_tokens * TOP_K * 3 * INTER * HIDDEN
    # Equal FLOPs, one dense block-FP8 GEMM: [T * k, D] x [3 I, D]^T.
    dense_x = torch.randn(num_tokens * TOP_K, HIDDEN, device="cuda").bfloat16()
    dense_w, dense_s = quantize_block_fp8(torch.randn(3 * INTER, HIDDEN, device="cuda"))
    dense_ms = graph_ms(lambda: fp8_linear_scaled_mm(dense_x, dense_w, dense_s, 128))
    loop_ms = None
    if with_loop and num_tokens <= 2048:
        torch.cuda.synchronize()
        import triton

        loop_ms = triton.testing.do_bench(lambda: loop_moe(x, ids, weights, w), rep=20)
    gbs = expert_bytes / fused_ms / 1e6
    return [num_tokens, "skewed" if skewed else "uniform", hit, f"{fused_ms * 1e3:.0f}",
            "-" if loop_ms is None else f"{loop_ms * 1e3:.0f}",
            f"{gbs:.0f} ({gbs / copy_gbs:.2f})", f"{flops / fused_ms / 1e9:.0f}",
            f"{flops / dense_ms / 1e9:.0f}", f"{dense_ms / fused_ms:.2f}"]


# Launch shapes the sweep times (the default first).
# 64 rows and 8 warps throughout: 128-row blocks or 4 warps spill registers on sm_90 (two
# 128-column fp32 accumulators and their per-block partials; tools/smem_check.py).
SWEEP = [DEFAULT_DISPATCH.w8a8,
         W8A8MoeConfig(gate_up_stages=4, down_stages=4),
         W8A8MoeConfig(group_m=4),
         W8A8MoeConfig(group_m=16, gate_up_stages=4, down_stages=4),
         W8A8MoeConfig(block_k=64, gate_up_stages=4, down_stages=4),
         W8A8MoeConfig(block_k=64, gate_up_stages=6, down_stages=6)]


def _shape(cfg) -> str:
    if isinstance(cfg, W8A8MoeConfig):
        return (f"w8a8 BM{cfg.block_m} G{cfg.group_m} gate/up {cfg.gate_up_warps}w"
                f"{cfg.gate_up_stages}s down {cfg.down_warps}w{cfg.down_stages}s")
    return f"bf16 BM{cfg.block_m} BN{cfg.block_n} BK{cfg.block_k} {cfg.num_warps}w"


def prefill_forms(num_tokens: int, w: list[torch.Tensor], sweep: bool) -> str:
    """One row per form / launch shape at `num_tokens` (uniform routing), against the dense
    equal-FLOP block-FP8 GEMM; the fastest W8A8 shape is marked."""
    x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = routing(num_tokens, False)
    flops = 2 * num_tokens * TOP_K * 3 * INTER * HIDDEN
    dense_x = torch.randn(num_tokens * TOP_K, HIDDEN, device="cuda").bfloat16()
    dense_w, dense_s = quantize_block_fp8(torch.randn(3 * INTER, HIDDEN, device="cuda"))
    dense_ms = graph_ms(lambda: fp8_linear_scaled_mm(dense_x, dense_w, dense_s, 128))
    rows, best = [], None
    for cfg in [PREFILL_CONFIG] + (SWEEP if sweep else SWEEP[:1]):
        ms = graph_ms(lambda c=cfg: fused_moe(x, ids, weights, *w, limit=LIMIT, config=c),
                      rep=50)
        rows.append([num_tokens, _shape(cfg), f"{ms * 1e3:.0f}", f"{flops / ms / 1e9:.0f}",
                     f"{flops / dense_ms / 1e9:.0f}", f"{dense_ms / ms:.2f}"])
        print(rows[-1], flush=True)
        if isinstance(cfg, W8A8MoeConfig) and (best is None or ms < best[0]):
            best = (ms, len(rows) - 1)
    rows[best[1]][1] += " (fastest)"
    sort_ms = graph_ms(lambda: sort_pairs(ids, EXPERTS, DEFAULT_DISPATCH.w8a8.block_m))
    print(f"sort alone at {num_tokens} tokens (BM {DEFAULT_DISPATCH.w8a8.block_m}): "
          f"{sort_ms * 1e3:.0f} us", flush=True)
    return table(["tokens", "form, launch shape", "us", "TFLOP/s", "dense _scaled_mm TFLOP/s",
                  "fused / dense (goal 0.7)"], rows)


def _parts(x, ids, cfg):
    """The inputs of the two GEMMs (quantised x, the sorted layout)."""
    xq, xs = quantize_activations(x, torch.float8_e4m3fn, 128)
    sorted_pairs, block_expert = sort_pairs(ids, EXPERTS, cfg.block_m, SORT_SCAN)
    return xq, xs, sorted_pairs, block_expert


def parts_rows(num_tokens: int, skewed: bool, w: list[torch.Tensor], dense: dict) -> list:
    """The sort (one launch vs histogram + scatter), the two W8A8 GEMMs, the rest (measured
    total minus the GEMMs), and the total against the dense GEMMs of equal FLOPs."""
    x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = routing(num_tokens, skewed)
    flops = 2 * num_tokens * TOP_K * 3 * INTER * HIDDEN
    cfg = DEFAULT_DISPATCH.w8a8
    sort_old = graph_ms(lambda: sort_pairs(ids, EXPERTS, cfg.block_m, SORT_ONE), rep=30)
    sort_new = graph_ms(lambda: sort_pairs(ids, EXPERTS, cfg.block_m, SORT_SCAN), rep=30)
    xq, xs, rows, blocks = _parts(x, ids, cfg)
    full = graph_ms(lambda: fused_moe(x, ids, weights, *w, limit=LIMIT, config=cfg,
                                      sort=SORT_SCAN), rep=50)
    gemms = graph_ms(lambda: w8a8_experts(
        xq, xs, rows, blocks, TOP_K, w[0], w[1], w[2], w[3], w[4], w[5], limit=LIMIT,
        block=128, out_dtype=x.dtype, config=cfg), rep=50)
    label = "skewed" if skewed else "uniform"
    out = [[num_tokens, label, "sort one launch / scan", f"{sort_old * 1e3:.0f} / "
            f"{sort_new * 1e3:.0f}", "-", "-", "-"],
           [num_tokens, label, "GEMMs", f"{gemms * 1e3:.0f}", f"{flops / gemms / 1e9:.0f}", "-",
            "-"],
           [num_tokens, label, "rest (sort, quantiser, sum: total - GEMMs)",
            f"{(full - gemms) * 1e3:.0f}", "-", "-", "-"],
           [num_tokens, label, "total", f"{full * 1e3:.0f}", f"{flops / full / 1e9:.0f}",
            f"{full * 1e3:.0f}",
            f"{dense['per-tensor'] / full:.2f} / {dense['blockwise'] / full:.2f}"]]
    for r in out:
        print(r, flush=True)
    return out


def dense_ms(num_tokens: int) -> dict:
    """Equal-FLOP dense FP8 GEMMs: [T * k, D] x [3 I, D]^T, per-tensor and block-scaled."""
    x = torch.randn(num_tokens * TOP_K, HIDDEN, device="cuda").bfloat16()
    wq, ws = quantize_block_fp8(torch.randn(3 * INTER, HIDDEN, device="cuda"))
    xq, one = x.to(torch.float8_e4m3fn), torch.ones((), device="cuda")
    per_tensor = graph_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16), rep=50)
    blockwise = graph_ms(lambda: fp8_linear_scaled_mm(x, wq, ws, 128), rep=50)
    return {"per-tensor": per_tensor, "blockwise": blockwise}


def parts_table(num_tokens: int = 8192) -> str:
    """Prefill at `num_tokens` by parts (uniform and skewed routing) against the dense GEMMs."""
    w = expert_weights()
    dense = dense_ms(num_tokens)
    flops = 2 * num_tokens * TOP_K * 3 * INTER * HIDDEN
    print(f"dense equal-FLOP GEMM at {num_tokens} tokens: per-tensor "
          f"{dense['per-tensor'] * 1e3:.0f} us ({flops / dense['per-tensor'] / 1e9:.0f} "
          f"TFLOP/s), blockwise "
          f"{dense['blockwise'] * 1e3:.0f} us ({flops / dense['blockwise'] / 1e9:.0f})",
          flush=True)
    rows = parts_rows(num_tokens, False, w, dense) + parts_rows(num_tokens, True, w, dense)
    return table(["tokens", "routing", "part", "us", "TFLOP/s", "total us",
                  "dense / total: per-tensor / blockwise (goal 0.7)"], rows)


def decode_sweep(token_counts: list[int]) -> None:
    """Graph times of the decode GEMMs' launch shapes (both grouped GEMMs take the shape), the
    dequantising form and the fp16-codes form, against the expert bytes touched at the copy
    bandwidth of the same run."""
    copy_gbs = copy_bandwidth()
    w = expert_weights()
    shapes = [FusedMoeConfig(block_n=bn, block_k=bk, num_stages=st)
              for bn in (32, 64, 128) for bk in (64, 128) for st in (3, 5)]
    shapes.append(FusedMoeConfig(num_warps=8))
    shapes += [FusedMoeConfig(block_n=bn, num_stages=st, fp16_codes=True)
               for bn in (32, 64, 128) for st in (3, 5)]
    rows = []
    for num_tokens in token_counts:
        x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
        ids, weights = routing(num_tokens, False)
        moved = ids.unique().numel() * 3 * INTER * HIDDEN
        for cfg in shapes:
            call = functools.partial(fused_moe, x, ids, weights, *w, limit=LIMIT, config=cfg)
            us = 1e3 * graph_ms(call)
            gbs = moved / us / 1e3
            rows.append([num_tokens, f"{cfg.block_n}/{cfg.block_k}/{cfg.num_stages}/"
                         f"{cfg.num_warps}{' fp16 codes' if cfg.fp16_codes else ''}",
                         f"{us:.1f}", f"{gbs:.0f} ({gbs / copy_gbs:.2f})"])
            print(rows[-1], flush=True)
    print(f"HBM copy {copy_gbs:.0f} GB/s (read + write); decode default {DECODE_CONFIG}")
    print(table(["tokens", "block n / k / stages / warps", "us (graph)",
                 "expert GB/s (of copy)"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 2048, 8192])
    parser.add_argument("--no-loop", action="store_true", help="skip the per-expert loop")
    parser.add_argument("--forms", type=int, nargs="+", default=None,
                        help="prefill sizes: W8A8 vs bf16 form only")
    parser.add_argument("--sweep", action="store_true", help="with --forms: W8A8 shapes")
    parser.add_argument("--decode-sweep", action="store_true",
                        help="decode launch shapes at --tokens (uniform routing)")
    args = parser.parse_args()
    if args.decode_sweep:
        decode_sweep(args.tokens)
        return
    if args.forms:
        w = expert_weights()
        tables = [prefill_forms(n, w, args.sweep) for n in args.forms]
        print("\nFused MoE prefill forms, 288 experts x 4096 x 2048, top-8, uniform routing, "
              "CUDA-graph timed\n\n" + "\n\n".join(tables), flush=True)
        return
    copy_gbs = copy_bandwidth()
    w = expert_weights()
    rows = []
    for num_tokens in args.tokens:
        for skewed in (False, True):
            rows.append(row(num_tokens, skewed, w, copy_gbs, not args.no_loop))
            print(rows[-1], flush=True)
    print(f"HBM copy {copy_gbs:.0f} GB/s (read + write)")
    print(table(["tokens", "routing", "experts hit", "fused us", "loop us",
                 "expert GB/s (of copy)", "fused TFLOP/s", "dense _scaled_mm TFLOP/s",
                 "fused / dense (goal 0.7 at 8192)"], rows))


if __name__ == "__main__":
    main()
