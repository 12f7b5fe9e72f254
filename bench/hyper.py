"""mHC pre/post at release shapes (S = 4, D = 4096, bf16): Triton against the reference.

    PYTHONPATH=. python bench/hyper.py [--tokens 1,4,32,2048] [--sweep] [--parts] [--out FILE]

One row per (op, tokens): the median of triton.testing.do_bench (L2 flushed between reps; at
decode sizes this includes the host launch), the kernel alone replayed from a CUDA graph over
copies of the inputs that keep replays out of L2 (each sub-layer has its own fn), the
reference's do_bench median, the bytes the kernel must move (read + written), the bandwidth that
gives at the graph time against a device-to-device copy measured in the same run, and the
largest difference from the reference in fp32. --sweep also prints graph times of other launch
shapes; --parts the graph time of hyper_pre with one part of its finish changed at a time
(input norm on as the model runs it, Sinkhorn iterations 1 against 20, the K split), to see
where a latency-bound decode launch goes. The table is printed and appended to bench/RESULTS.md
(or to --out).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    append_results,
    bench_ms,
    copies,
    copy_bandwidth,
    device_description,
    git_commit,
    graph_ms,
    table,
)
from glmflash.kernels.hyper import hyper_post_ref, hyper_pre_ref  # noqa: E402

S, D = 4, 4096
N = (2 + S) * S
KW = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
HEADER = ["op", "tokens", "triton us (do_bench)", "triton us (graph)", "ref us (do_bench)",
          "MB moved", "GB/s (graph)", "of copy", "max abs diff vs fp32 ref (weights / out)"]


def _inputs(tokens: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    x = dict(streams=rnd(tokens, S, D).bfloat16(),
             fn=(rnd(N, S * D) * 2 / (S * D) ** 0.5).bfloat16(), base=rnd(N) * 0.5,
             scale=1 + 0.2 * rnd(3), y=rnd(tokens, D).bfloat16())
    x["post"], x["comb"], _ = hyper_pre_ref(x["streams"], x["fn"], x["base"], x["scale"], **KW)
    return x


def _pre_bytes(tokens: int) -> int:
    return 2 * (tokens * S * D + N * S * D + tokens * D) + 4 * tokens * (S + S * S)


def _post_bytes(tokens: int) -> int:
    return 2 * (tokens * D + 2 * tokens * S * D) + 4 * tokens * (S + S * S)


def _pre_graph_us(x: dict, config=None, **changes) -> float:
    """Graph replays of hyper_pre over distinct (streams, fn) copies; `changes` replace KW's
    arguments or add hyper_pre's (`norm`)."""
    from glmflash.kernels.hyper import triton_impl as ti

    calls = [functools.partial(ti.hyper_pre, x["streams"].clone(), x["fn"].clone(), x["base"],
                               x["scale"], **{**KW, **changes}, config=config)
             for _ in range(copies(_pre_bytes(x["streams"].shape[0])))]
    return graph_ms(calls) * 1e3


def _post_graph_us(x: dict, config=None) -> float:
    from glmflash.kernels.hyper import triton_impl as ti

    calls = [functools.partial(ti.hyper_post, x["y"].clone(), x["streams"].clone(), x["post"],
                               x["comb"], config=config)
             for _ in range(copies(_post_bytes(x["streams"].shape[0])))]
    return graph_ms(calls) * 1e3


def pre_row(tokens: int, copy_gbs: float) -> list:
    from glmflash.kernels.hyper import triton_impl as ti

    x = _inputs(tokens)
    args = (x["streams"], x["fn"], x["base"], x["scale"])
    got = ti.hyper_pre(*args, **KW)
    want = hyper_pre_ref(x["streams"].float(), x["fn"].float(), x["base"], x["scale"], **KW)
    diff = [(g.float() - w).abs().max().item() for g, w in zip(got, want, strict=True)]
    diff = f"{max(diff[:2]):.1e} / {diff[2]:.1e}"
    us = bench_ms(lambda: ti.hyper_pre(*args, **KW)) * 1e3
    ref_us = bench_ms(lambda: hyper_pre_ref(*args, **KW)) * 1e3
    return _row("pre", tokens, us, _pre_graph_us(x), ref_us, _pre_bytes(tokens), copy_gbs, diff)


def post_row(tokens: int, copy_gbs: float) -> list:
    from glmflash.kernels.hyper import triton_impl as ti

    x = _inputs(tokens)
    args = (x["y"], x["streams"], x["post"], x["comb"])
    got = ti.hyper_post(*args)
    want = hyper_post_ref(x["y"].float(), x["streams"].float(), x["post"].bfloat16().float(),
                          x["comb"].bfloat16().float())
    diff = f"- / {(got.float() - want).abs().max().item():.1e}"
    us = bench_ms(lambda: ti.hyper_post(*args)) * 1e3
    ref_us = bench_ms(lambda: hyper_post_ref(*args)) * 1e3
    return _row("post", tokens, us, _post_graph_us(x), ref_us, _post_bytes(tokens), copy_gbs,
                diff)


def _row(op: str, tokens: int, us: float, graph_us: float, ref_us: float, moved: int,
         copy_gbs: float, diff: str) -> list:
    gbs = moved / graph_us / 1e3
    return [op, tokens, f"{us:.1f}", f"{graph_us:.1f}", f"{ref_us:.0f}", f"{moved / 1e6:.2f}",
            f"{gbs:.0f}", f"{gbs / copy_gbs:.0%}", diff]


def pre_sweep_configs(tokens: int) -> list:
    """Token blocks by FMA (up to the token count) with two product tiles and collapse tiles of
    4K, 8K and 16K values, the finish's first chunk of streams loaded before or after the
    weights, and on tensor cores from 16 tokens, each at a few split targets."""
    from glmflash.kernels.hyper.triton_impl import HyperPreConfig

    shapes = [(bt, bk, waves, 4096 * grow // (bt * S), early) for bt in (1, 2, 4, 8)
              if bt <= max(1, tokens) for bk in (128 // bt, 256 // bt)
              for waves in (1.0, 2.0, 4.0) for grow in (1, 2, 4) for early in (True, False)]
    shapes += [(bt, bk, waves, 4096 // (bt * S), True) for bt in (16, 32, 64)
               if bt <= max(16, tokens) for bk in (32, 64, 128) for waves in (0.5, 1.0, 2.0)]
    return [HyperPreConfig(block_t=bt, block_k=max(16, bk), waves=waves,
                           block_d=max(16, min(D, bd)), prefetch_streams=early)
            for bt, bk, waves, bd, early in shapes]


def sweep(token_counts: list[int]) -> None:
    """Graph times of hyper_pre / hyper_post launch shapes around the defaults (printed)."""
    from glmflash.kernels.hyper.triton_impl import HyperPostConfig

    for tokens in token_counts:
        x = _inputs(tokens)
        for cfg in pre_sweep_configs(tokens):
            print(f"sweep pre T={tokens} {cfg}: {_pre_graph_us(x, cfg):.1f} us", flush=True)
        for bd in (128, 256, 512, 1024, 2048):
            for warps in (4, 8):
                cfg = HyperPostConfig(block_d=bd, num_warps=warps)
                print(f"sweep post T={tokens} {cfg}: {_post_graph_us(x, cfg):.1f} us",
                      flush=True)
        torch.cuda.empty_cache()


def parts(token_counts: list[int]) -> None:
    """hyper_pre's decode launch with one part changed at a time (graph us, printed)."""
    import dataclasses

    from glmflash.kernels.hyper.triton_impl import default_pre_config
    from glmflash.kernels.triton_utils import num_sms

    for tokens in token_counts:
        x = _inputs(tokens)
        norm = (torch.ones(D, device="cuda").bfloat16(), 1e-5)
        base = default_pre_config(tokens, S, num_sms(torch.device("cuda")))
        cases = [("default, no norm", None, {}), ("with the input norm (model)", None,
                                                  {"norm": norm}),
                 ("sinkhorn_iters 1", None, {"sinkhorn_iters": 1}),
                 ("no prefetch", dataclasses.replace(base, prefetch_streams=False), {})]
        cases += [(f"{n} ranges", dataclasses.replace(base, splits=n), {})
                  for n in (1, 8, 16, 32, 128)]
        for name, cfg, changes in cases:
            print(f"parts pre T={tokens} {name}: {_pre_graph_us(x, cfg, **changes):.1f} us",
                  flush=True)
        print(f"parts post T={tokens}: {_post_graph_us(x):.1f} us", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,4,32,2048",
                        help="comma-separated token counts (default: %(default)s)")
    parser.add_argument("--sweep", action="store_true",
                        help="also print graph times of other launch shapes")
    parser.add_argument("--parts", action="store_true",
                        help="only hyper_pre's graph time with one part changed at a time")
    parser.add_argument("--out", type=Path, default=None,
                        help="append the table here instead of to bench/RESULTS.md")
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench/hyper.py needs a CUDA device")
    if args.parts:
        parts(token_counts)
        return
    copy_gbs = copy_bandwidth()
    print(f"device-to-device copy: {copy_gbs:.0f} GB/s", flush=True)
    rows = []
    for tokens in token_counts:
        for make in (pre_row, post_row):
            rows.append(make(tokens, copy_gbs))
            print(rows[-1], flush=True)
    title = (f"mHC pre / post, S={S} D={D} bf16, Triton vs ref (bench/hyper.py; copy "
             f"{copy_gbs:.0f} GB/s)")
    body = table(HEADER, rows)
    print(f"\n## {title}\n\n{body}", flush=True)
    _emit(title, body, args.out)
    if args.sweep:
        sweep(token_counts)


def _emit(title: str, body: str, out: Path | None) -> None:
    if out is None:
        append_results(title, body)
        return
    stamp = datetime.date.today().isoformat()
    with out.open("a") as f:
        f.write(f"\n## {title}\n\n{stamp} · {device_description()} · commit {git_commit()}\n\n"
                f"{body}\n")


if __name__ == "__main__":
    main()
