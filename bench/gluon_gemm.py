"""The warp-specialised Gluon FP8 GEMM (fp8_gemm/gluon_sm90.py) on the H200, against cuBLASLt in
the same run: its error against the fp32 product of the dequantised operands, and its time.

    python bench/gluon_gemm.py [--part dense|moe|all] [--m 2048 8192] [--tokens 8192]
                               [--candidates "default,a program per tile"]

dense: at each release shape, the GEMM alone on quantised inputs: Gluon, cuBLASLt block-scaled
`_scaled_mm` (same inputs), cuBLASLt per-tensor `_scaled_mm`, the Triton W8A8 GEMM.
moe: the fused MoE prefill at release shapes (288 experts x 2048, top-8): the Gluon form against
the Triton W8A8 form (the same sort, quantiser and sum) and a dense equal-FLOP GEMM.
Each part runs in its own process under a time limit (a hung kernel cannot hold the run).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms, kernel_ms, rel, table  # noqa: E402

SHAPES = [(4096, 1536), (1536, 16384), (16384, 4096), (4096, 4096), (4096, 24576)]


def candidates(names: str) -> dict:
    """Named launch shapes of the Gluon GEMM to time side by side (the first is the reference
    of the tables' ratios)."""
    from glmflash.kernels.fp8_gemm.gluon_sm90 import GLUON_CONFIG

    known = {
        "default": GLUON_CONFIG,
        "a program per tile": replace(GLUON_CONFIG, persistent=False),
        "narrow stores": replace(GLUON_CONFIG, wide_stores=False),
        "unswizzled stash": replace(GLUON_CONFIG, stash_swizzle=False),
        "7/5 stages + narrow stores": replace(GLUON_CONFIG, wide_stores=False, stages=7,
                                              gated_stages=5),
    }
    unknown = [name for name in names.split(",") if name not in known]
    if unknown:
        raise SystemExit(f"unknown candidates {unknown}; known: {sorted(known)}")
    return {name: known[name] for name in names.split(",")}


def block_scaled_operands(m: int, k: int, n: int) -> tuple:
    """Random block-FP8 operands of an `[m, k] x [n, k]^T` GEMM: (activations e4m3, their
    1x128 scales M-major, weights e4m3, their 128x128 scales), as `fp8_linear` quantises."""
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations

    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda") * 0.05)
    x = torch.randn(m, k, device="cuda").bfloat16()
    xq, xs = quantize_activations(x, wq.dtype, 128, scales_m_major=True)
    return xq, xs, wq, ws


def _dequant_product(xq, xs, wq, ws) -> torch.Tensor:
    """fp32 (xq * xs) (wq * ws)^T with xs `[M, K/128]`, ws `[N/128, K/128]`."""
    from glmflash.kernels.fp8_gemm import dequantize_block_fp8

    a = xq.float() * xs.repeat_interleave(128, dim=1)[:, :xq.shape[1]]
    return a @ dequantize_block_fp8(wq, ws).t()


def dense_row(m: int, k: int, n: int, configs: dict) -> list:
    """One shape: times (TFLOP/s) of the Gluon candidates and the three other GEMMs, and the
    errors of Gluon (its first candidate) and cuBLAS."""
    import triton

    from glmflash.kernels.fp8_gemm import gluon_sm90
    from glmflash.kernels.fp8_gemm.triton_impl import DEFAULT_CONFIG, fp8_gemm_kernel

    xq, xs, wq, ws = block_scaled_operands(m, k, n)
    # The Triton W8A8 GEMM reads the same scales row-major.
    xs_r = xs.contiguous()
    ref = _dequant_product(xq, xs, wq, ws)
    first = next(iter(configs.values()))
    out = gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16, config=first)
    torch.cuda.synchronize()
    err = rel(out.float(), ref)
    cublas = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
    err_cublas = rel(cublas.float(), ref)
    one = torch.ones((), device="cuda")
    t_gluons = [graph_ms(lambda c=c: gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16, config=c))
                for c in configs.values()]
    for c in list(configs.values())[1:]:
        assert torch.equal(gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16, config=c), out)
    t_gluon = t_gluons[0]
    t_block = graph_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(),
                                                out_dtype=torch.bfloat16))
    t_tensor = graph_ms(lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                 out_dtype=torch.bfloat16))
    bm, bn, warps, stages = DEFAULT_CONFIG.w8a8_tile
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    def triton_w8a8():
        fp8_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
            xq, xs_r, wq, ws, y, m, n, k, xq.stride(0), xs_r.stride(0), wq.stride(0),
            ws.stride(0), y.stride(0), BLOCK=128, BM=bm, BN=bn, GROUP_M=8,
            num_warps=warps, num_stages=stages)

    t_triton = graph_ms(triton_w8a8)
    flops = 2 * m * n * k
    row = [f"{k}->{n}", m, *(f"{t * 1e3:.1f} ({flops / t / 1e9:.0f})" for t in t_gluons),
           f"{t_block * 1e3:.1f} ({flops / t_block / 1e9:.0f})",
           f"{t_tensor * 1e3:.1f} ({flops / t_tensor / 1e9:.0f})",
           f"{t_triton * 1e3:.1f}", f"{t_tensor / t_gluon:.2f}",
           f"{err:.1e} / {err_cublas:.1e}"]
    print(row, flush=True)
    return row


def dense(ms: list[int], configs: dict) -> None:
    rows = [dense_row(m, k, n, configs) for m in ms for k, n in SHAPES]
    print(table(["shape K->N", "M", *(f"Gluon {name} us (TFLOP/s)" for name in configs),
                 "cuBLAS blockwise us",
                 "per-tensor us", "Triton W8A8 us", "per-tensor / Gluon",
                 "rel err Gluon / cuBLAS"], rows))


def moe(token_counts: list[int], configs: dict) -> None:
    from bench.fused_moe import dense_ms, expert_weights

    w = expert_weights()
    rows = []
    for num_tokens in token_counts:
        dense_t = dense_ms(num_tokens)
        rows += [moe_row(num_tokens, skewed, w, dense_t, name, config)
                 for skewed in (False, True) for name, config in configs.items()]
    print(table(["tokens", "routing", "Gluon GEMM", "Triton W8A8 us", "Gluon us",
                 "Gluon parts: gather / gate-up (TFLOP/s) / down (TFLOP/s) us", "Gluon TFLOP/s",
                 "dense / Gluon: per-tensor / blockwise (goal 0.7)", "rel diff vs Triton"],
                rows))


def gluon_parts(x, ids, w, config) -> str:
    """The Gluon form's three launches after the sort and quantiser, each timed alone."""
    from bench.fused_moe import EXPERTS, HIDDEN, INTER, LIMIT, TOP_K
    from glmflash.kernels.fp8_gemm import gluon_sm90
    from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations
    from glmflash.kernels.fused_moe.gluon_w8a8 import gather_rows
    from glmflash.kernels.fused_moe.triton_impl import sort_pairs

    xq, xs = quantize_activations(x, torch.float8_e4m3fn, 128)
    pairs, blocks = sort_pairs(ids, EXPERTS, 128)
    aq, a_s = gather_rows(xq, xs, pairs, blocks, TOP_K)
    hq, hs = gluon_sm90.grouped_gate_up(aq, a_s, blocks, w[0], w[1], w[2], w[3], limit=LIMIT,
                                        config=config)
    rows = int((blocks >= 0).sum()) * 128
    t_gather = graph_ms(lambda: gather_rows(xq, xs, pairs, blocks, TOP_K), rep=30)
    t_gate_up = graph_ms(lambda: gluon_sm90.grouped_gate_up(aq, a_s, blocks, w[0], w[1], w[2],
                                                            w[3], limit=LIMIT, config=config),
                         rep=30)
    t_down = graph_ms(lambda: gluon_sm90.grouped_down(hq, hs, blocks, pairs, w[4], w[5],
                                                      x.shape[0] * TOP_K, x.dtype,
                                                      config=config), rep=30)
    # FLOPs of the rows computed (padding included): what the tensor cores run.
    f_gate_up, f_down = 2 * rows * HIDDEN * 2 * INTER, 2 * rows * INTER * HIDDEN
    return (f"{t_gather * 1e3:.0f} / {t_gate_up * 1e3:.0f} ({f_gate_up / t_gate_up / 1e9:.0f}) "
            f"/ {t_down * 1e3:.0f} ({f_down / t_down / 1e9:.0f}); {rows} rows")


def moe_row(num_tokens: int, skewed: bool, w: list, dense_t: dict, name: str,
            gemm_config) -> list:
    """The fused MoE at one size and routing: the Triton W8A8 form against the Gluon form on
    one launch shape of its GEMM."""
    from bench.fused_moe import HIDDEN, INTER, LIMIT, TOP_K, routing
    from glmflash.kernels.fused_moe.gluon_w8a8 import GluonMoeConfig
    from glmflash.kernels.fused_moe.triton_impl import DEFAULT_DISPATCH, fused_moe

    flops = 2 * num_tokens * TOP_K * 3 * INTER * HIDDEN
    x = torch.randn(num_tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = routing(num_tokens, skewed)
    triton_cfg = DEFAULT_DISPATCH.w8a8
    gluon_cfg = GluonMoeConfig(gemm=gemm_config)
    ref = fused_moe(x, ids, weights, *w, limit=LIMIT, config=triton_cfg)
    out = fused_moe(x, ids, weights, *w, limit=LIMIT, config=gluon_cfg)
    torch.cuda.synchronize()
    err = rel(out.float(), ref.float())
    t_triton = graph_ms(lambda: fused_moe(x, ids, weights, *w, limit=LIMIT,
                                          config=triton_cfg), rep=30)
    t_gluon = graph_ms(lambda: fused_moe(x, ids, weights, *w, limit=LIMIT,
                                         config=gluon_cfg), rep=30)
    parts = gluon_parts(x, ids, w, gemm_config)
    # The whole call's launches (profiler, not graph-timed): where the time outside the GEMMs
    # goes.
    launches = kernel_ms(lambda: fused_moe(x, ids, weights, *w, limit=LIMIT, config=gluon_cfg))
    print("launches (us): " + ", ".join(f"{name[:40]} {ms * 1e3:.0f}"
                                         for name, ms in launches.items()), flush=True)
    row = [num_tokens, "skewed" if skewed else "uniform", name, f"{t_triton * 1e3:.0f}",
           f"{t_gluon * 1e3:.0f}", parts, f"{flops / t_gluon / 1e9:.0f}",
           f"{dense_t['per-tensor'] / t_gluon:.2f} / "
           f"{dense_t['blockwise'] / t_gluon:.2f}", f"{err:.1e}"]
    print(row, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--part", choices=["dense", "moe", "all"], default="all")
    ap.add_argument("--m", type=int, nargs="+", default=[2048])
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--limit-s", type=int, default=240)
    ap.add_argument("--candidates", default="default",
                    help="comma-separated launch shapes of the Gluon GEMM (candidates())")
    args = ap.parse_args()
    if args.part == "all":
        for part in ("dense", "moe"):
            cmd = [sys.executable, __file__, "--part", part, "--m", *map(str, args.m),
                   "--tokens", *map(str, args.tokens), "--candidates", args.candidates,
                   "--limit-s", str(args.limit_s)]
            try:
                rc = subprocess.run(cmd, timeout=args.limit_s).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout (hung?)"
            print(f"== part {part}: rc={rc}", flush=True)
        return
    configs = candidates(args.candidates)
    if args.part == "dense":
        dense(args.m, configs)
    else:
        moe(args.tokens, configs)


if __name__ == "__main__":
    main()
