"""The decode launches folded into their neighbours, each against the launches it replaced, at
release shapes, CUDA-graph timed (the step's form), one table:

- router: the choice inside the scores launch (`ScoreConfig.fused_select`) against its own;
- SwiGLU: the FP8 down projection forming it as it reads the stacked [gate | up] product
  (`fp8_linear(..., swiglu_limit=)`) against the SwiGLU launch and the projection, for the
  shared expert (2048 -> 4096) and the dense MLP (12288 -> 4096);
- MoE sum: hyper_post summing the routed experts' rows (`ExpertRows`) against the sum launch
  and hyper_post.

    PYTHONPATH=. python bench/decode_fusions.py [--tokens 1 2 8 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms, table  # noqa: E402

HIDDEN, EXPERTS, TOP_K, STREAMS, LIMIT = 4096, 288, 8, 4, 10.0
DEVICE = "cuda"


def router_rows(tokens: int) -> list:
    from glmflash.kernels.router import RouterSpec
    from glmflash.kernels.router.triton_impl import default_score_config, route

    spec = RouterSpec(TOP_K, 1, 1, True, 2.5)
    x = torch.randn(tokens, HIDDEN, device=DEVICE).bfloat16()
    weight = (torch.randn(EXPERTS, HIDDEN, device=DEVICE) / 64).bfloat16()
    bias = torch.randn(EXPERTS, device=DEVICE) * 0.1
    fused = dataclasses.replace(default_score_config(tokens), fused_select=True)
    apart = dataclasses.replace(fused, fused_select=False)
    return [_row("router", f"{tokens} tokens",
                 lambda: route(x, weight, bias, spec=spec, score_config=apart),
                 lambda: route(x, weight, bias, spec=spec, score_config=fused))]


def swiglu_rows(tokens: int) -> list:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm.triton_impl import DEFAULT_CONFIG, fp8_linear

    # The fold wherever the weight-only kernel runs (the default folds only at one row, K 4096).
    fold_everywhere = dataclasses.replace(DEFAULT_CONFIG, swiglu_fold_max_k=1 << 30,
                                          swiglu_fold_max_rows=DEFAULT_CONFIG.codes_max_rows)
    from glmflash.kernels.swiglu.triton_impl import clamped_swiglu_stacked

    rows = []
    for name, width in (("shared expert", 2048), ("dense MLP", 12288)):
        w, s = quantize_block_fp8(torch.randn(HIDDEN, width, device=DEVICE) * 0.02)
        gate_up = (torch.randn(tokens, 2 * width, device=DEVICE) * 4).bfloat16()
        rows.append(_row("SwiGLU + down", f"{name}, {tokens} rows",
                         lambda g=gate_up, w=w, s=s: fp8_linear(
                             clamped_swiglu_stacked(g, LIMIT), w, s),
                         lambda g=gate_up, w=w, s=s: fp8_linear(
                             g, w, s, swiglu_limit=LIMIT, config=fold_everywhere)))
    return rows


def moe_sum_rows(tokens: int) -> list:
    from glmflash.kernels.fused_moe.expert_rows import ExpertRows, sum_rows
    from glmflash.kernels.hyper.triton_impl import hyper_post

    routed = ExpertRows(torch.randn(tokens * TOP_K, HIDDEN, device=DEVICE).bfloat16(),
                        torch.randint(0, EXPERTS, (tokens, TOP_K), device=DEVICE),
                        torch.rand(tokens, TOP_K, device=DEVICE), EXPERTS)
    shared = torch.randn(tokens, HIDDEN, device=DEVICE).bfloat16()
    streams = torch.randn(tokens, STREAMS, HIDDEN, device=DEVICE).bfloat16()
    post = torch.rand(tokens, STREAMS, device=DEVICE)
    comb = torch.rand(tokens, STREAMS, STREAMS, device=DEVICE)
    return [_row("MoE sum + hyper_post", f"{tokens} tokens",
                 lambda: hyper_post(sum_rows(routed), streams, post, comb, extra=shared),
                 lambda: hyper_post(routed, streams, post, comb, extra=shared))]


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _row(op: str, shape: str, apart, fused) -> list:
    assert torch.equal(_first(apart()), _first(fused())), f"{op}, {shape}: not the same bits"
    before, after = (1e3 * graph_ms(f) for f in (apart, fused))
    print(f"{op}, {shape}: {before:.1f} -> {after:.1f} us", flush=True)
    return [op, shape, f"{before:.1f}", f"{after:.1f}", f"{before - after:+.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 8, 32])
    args = parser.parse_args()
    rows = []
    for tokens in args.tokens:
        rows += router_rows(tokens) + swiglu_rows(tokens) + moe_sum_rows(tokens)
    print(table(["fold", "shape", "launches apart us", "folded us", "saved us"], rows))


if __name__ == "__main__":
    main()
