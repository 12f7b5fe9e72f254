"""CPU routed experts (one MoE layer, FP8) against a memory-bandwidth probe run in the same process.

    python bench/cpu_moe.py            # release shapes: E=288, D=4096, I=2048, top-8 (~7.25 GB)
    python bench/cpu_moe.py --quick    # E=32, D=2048, I=1024 (~200 MB), last line bandwidth_ratio=
    python bench/cpu_moe.py --pools 2  # two thread pools, each owning half of every expert's rows
    python bench/cpu_moe.py --codes uniform --decode fp32-bits  # the denormal worst case

GB/s counts the bytes of the distinct experts a call touches (FP8 weights + fp32 scales). Calls
walk a random expert permutation so consecutive calls hit different experts: the weights come from
DRAM, not from the last call's cache. The table is appended to bench/RESULTS.md.

GOMP_SPINCOUNT is set (unless given) before torch and numba load their two OpenMP runtimes: with
the default (long) spin, idle threads of one pool steal the cores the other one needs.
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("GOMP_SPINCOUNT", "10000")
if "--asm" in sys.argv:
    # numba refuses to show the assembly of cached code: compile into a fresh cache
    os.environ["NUMBA_CACHE_DIR"] = tempfile.mkdtemp(prefix="cpu_moe_asm_")

import argparse
import datetime
import platform
import re
import time
from pathlib import Path

import numba
import numpy as np
import torch
from numba import njit, prange

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import git_commit  # noqa: E402
from glmflash.kernels.cpu_moe import numba_kernels, routed_experts_ref  # noqa: E402
from glmflash.kernels.cpu_moe.decode_choice import subnormal_share  # noqa: E402
from glmflash.kernels.cpu_moe.numba_impl import NumbaMoeExperts  # noqa: E402
from glmflash.kernels.fp8_gemm.ref import FP8_DTYPE, quantize_block_fp8  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PROBE_CHUNKS = 256


@njit(cache=True, nogil=True, fastmath=True)
def _sum_chunk_nb(a):
    acc = np.float32(0.0)
    for i in range(a.size):
        acc += a[i]
    return acc


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _read_sum_nb(a, partial):
    per = a.size // partial.size
    for c in prange(partial.size):
        partial[c] = _sum_chunk_nb(a[c * per:(c + 1) * per])


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _add_nb(a, b, c):
    for i in prange(a.size):
        c[i] = a[i] + b[i]


@njit(cache=True, nogil=True, parallel=True)
def _spin_nb(num_iters, out):
    for c in prange(out.size):
        acc = np.float32(c)
        for _ in range(num_iters):
            acc = acc * np.float32(0.999) + np.float32(1.0)
        out[c] = acc


def median_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def compute_scaling(num_threads: int) -> float:
    """Speed-up of a compute-bound loop from 1 to num_threads threads (how many cores we get)."""
    out = np.zeros(64, np.float32)
    times = []
    for threads in (1, num_threads):
        numba.set_num_threads(threads)
        times.append(median_time(lambda: _spin_nb(200_000, out), 3))
    numba.set_num_threads(num_threads)
    return times[0] / times[1]


def random_fp8(*shape: int) -> torch.Tensor:
    """Uniform random e4m3 bytes without the NaN codes 0x7F / 0xFF, filled one expert at a time."""
    w = torch.empty(shape, dtype=torch.uint8)
    for e in range(shape[0]):
        w[e] = torch.randint(0, 256, shape[1:], dtype=torch.uint8)
        w[e][(w[e] & 0x7F) == 0x7F] -= 1
    return w.view(FP8_DTYPE)


def quantized_fp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian weights quantised like a checkpoint (one amax scale per 128x128 block), one
    expert at a time: the e4m3 codes, subnormals included, are distributed as in real weights."""
    w = torch.empty(shape, dtype=FP8_DTYPE)
    scales = torch.empty(shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    for e in range(shape[0]):
        w[e], scales[e] = quantize_block_fp8(torch.randn(shape[1:]))
    return w, scales


def make_layer(num_experts: int, hidden: int, inter: int, codes: str
               ) -> tuple[torch.Tensor, ...]:
    if codes == "quantized":
        return (*quantized_fp8(num_experts, inter, hidden),
                *quantized_fp8(num_experts, inter, hidden),
                *quantized_fp8(num_experts, hidden, inter))
    gate_w, up_w = random_fp8(num_experts, inter, hidden), random_fp8(num_experts, inter, hidden)
    down_w = random_fp8(num_experts, hidden, inter)
    s_gu = torch.full((num_experts, -(-inter // 128), -(-hidden // 128)), 1e-3)
    s_down = torch.full((num_experts, -(-hidden // 128), -(-inter // 128)), 1e-3)
    return gate_w, s_gu, up_w, s_gu.clone(), down_w, s_down


def routing(perm: torch.Tensor, call: int, num_tokens: int, top_k: int) -> torch.Tensor:
    """Token t of call i takes the next top_k experts of a fixed random permutation."""
    start = (call * num_tokens + torch.arange(num_tokens)) * top_k
    return perm[(start[:, None] + torch.arange(top_k)) % perm.numel()]


def bench_tokens(experts: NumbaMoeExperts, layer, num_tokens: int, probe: np.ndarray,
                 args) -> dict[str, float]:
    """Kernel GB/s (median call) against the read probe measured between rounds of calls."""
    hidden, top_k = experts.hidden, args.top_k
    perm = torch.randperm(experts.num_experts)
    x = torch.randn(num_tokens, hidden)
    weights = torch.rand(num_tokens, top_k)
    calls = [routing(perm, i, num_tokens, top_k) for i in range(args.iters + 3)]
    out = torch.empty(num_tokens, hidden)
    partial = np.zeros(PROBE_CHUNKS, np.float32)
    for ids in calls[:3]:
        experts.forward(x, ids, weights, out=out)
    times, num_hit, reads = [], [], []
    for i, ids in enumerate(calls[3:]):
        if i % max(1, args.iters // 4) == 0:
            reads.append(probe.nbytes / median_time(lambda: _read_sum_nb(probe, partial), 2) / 1e9)
        t0 = time.perf_counter()
        experts.forward(x, ids, weights, out=out)
        times.append(time.perf_counter() - t0)
        num_hit.append(ids.unique().numel())
    per_expert = sum(t[0].numel() * t.element_size() for t in layer)
    num_bytes = float(np.mean(num_hit)) * per_expert
    t_call = float(np.median(times))
    ref_s = median_time(lambda: routed_experts_ref(x, calls[0], weights, *layer,
                                                   swiglu_limit=10.0), args.ref_reps)
    return {"tokens": num_tokens, "experts": float(np.mean(num_hit)), "mb": num_bytes / 1e6,
            "ms": t_call * 1e3, "gbs": num_bytes / t_call / 1e9, "ref_ms": ref_s * 1e3,
            "read": float(np.median(reads))}


def device_line(num_threads: int) -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                  if ln.startswith("model name")), platform.processor())
    return (f"{model}, {os.cpu_count()} cores, {num_threads} threads, numba {numba.__version__} "
            f"({numba.threading_layer()}, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')})")




def format_table(rows: list[dict[str, float]], add: float, scaling: float, args) -> str:
    head = (f"\n## cpu_moe {'--quick' if args.quick else 'release'}: E={args.experts} "
            f"D={args.hidden} I={args.inter} top-{args.top_k}, pools={args.pools}, "
            f"{args.codes} codes ({100 * args.subnormal:.2f}% subnormal), decode {args.decode}, "
            f"{datetime.datetime.now():%Y-%m-%d %H:%M}, commit {git_commit()}\n\n"
            f"{device_line(args.threads)}; a+b->c {add:.1f} GB/s; compute scaling "
            f"1->{args.threads} threads {scaling:.2f}x\n\n"
            "| tokens | experts hit | MB streamed | numba ms | GB/s | read-probe GB/s | ratio | "
            "ref ms | ref / numba |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['tokens']} | {r['experts']:.1f} | {r['mb']:.1f} | {r['ms']:.3f} | "
             f"{r['gbs']:.1f} | {r['read']:.1f} | {r['gbs'] / r['read']:.2f} | "
             f"{r['ref_ms']:.1f} | {r['ref_ms'] / r['ms']:.0f}x |" for r in rows]
    return head + "\n".join(lines) + "\n"


def asm_report() -> str:
    """Instruction counts in the compiled kernels: is the hot loop AVX-512 (zmm)?"""
    lines = []
    for name in ("_gate_up_nb", "_down_nb"):
        asm = "\n".join(getattr(numba_kernels, name).inspect_asm().values())
        counts = {op: len(re.findall(pattern, asm)) for op, pattern in (
            ("fma zmm", r"vfmadd\w+\s+[^\n]*zmm"), ("fma ymm", r"vfmadd\w+\s+[^\n]*ymm"),
            ("vpmovsxbw zmm", r"vpmovsxbw\s+[^\n]*zmm"), ("prefetcht1", r"prefetcht1"),
            ("zmm operands", r"%zmm"))}
        lines.append(f"{name}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="E=32, D=2048, I=1024, under a minute")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--iters", type=int, default=None, help="timed calls per token count")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--pools", type=int, default=1,
                   help="thread pools (--kt-threadpool-count): each owns a slice of every expert")
    p.add_argument("--codes", choices=("quantized", "uniform"), default="quantized",
                   help="weights quantised from Gaussians like a checkpoint, or uniformly random "
                        "e4m3 codes (6%% subnormal: the worst case for the fp32-bits decode)")
    p.add_argument("--decode", choices=("fp16", "fp32-bits"), default=None,
                   help="e4m3 decode of the kernel (default: chosen for this CPU)")
    p.add_argument("--no-save", action="store_true", help="do not append to bench/RESULTS.md")
    p.add_argument("--asm", action="store_true", help="compile afresh and count zmm instructions")
    args = p.parse_args()
    args.experts, args.hidden, args.inter = (32, 2048, 1024) if args.quick else (288, 4096, 2048)
    args.top_k = 8
    args.iters = args.iters or (40 if args.quick else 20)
    args.ref_reps = 2 if args.quick else 1
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(42)
    numba.set_num_threads(args.threads)
    layer = make_layer(args.experts, args.hidden, args.inter, args.codes)
    args.subnormal = subnormal_share(*layer[0::2])
    experts = NumbaMoeExperts(*layer, swiglu_limit=10.0, num_threads=args.threads,
                              num_pools=args.pools, decode=args.decode)
    args.decode = experts.decode_name
    experts.warmup()
    if args.asm:
        print(asm_report())
    probe_bytes = (256 if args.quick else 1024) << 20
    probe = np.random.rand(probe_bytes // 4).astype(np.float32)
    scaling = compute_scaling(args.threads)
    rows = [bench_tokens(experts, layer, t, probe, args) for t in args.tokens]
    b, c = np.ones_like(probe), np.empty_like(probe)
    add = 3 * probe.nbytes / median_time(lambda: _add_nb(probe, b, c), 5) / 1e9
    table = format_table(rows, add, scaling, args)
    print(table)
    if not args.no_save:
        with RESULTS.open("a") as f:
            if f.tell() == 0:
                f.write("# Benchmark results (appended by the bench/ scripts)\n")
            f.write(table)
    first = next((r for r in rows if r["tokens"] == 1), None)
    first = first or bench_tokens(experts, layer, 1, probe, args)
    print(f"bandwidth_ratio={first['gbs'] / first['read']:.3f}")


if __name__ == "__main__":
    main()
