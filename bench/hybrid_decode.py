"""Hybrid decode: CPU experts overlapped with the GPU's shared and resident experts.

MoE layers at release width (288 experts, hidden 4096, width 2048, top-8, FP8 + block scales;
the layers share one host copy of the expert weights), router and shared expert on the GPU,
`--gpu-experts` resident per layer, the rest on the CPU kernel. Per decode step (all layers):
the step's wall time, the CPU kernel's time (on the worker), the GPU time from each hand-off to
the end of the shared and resident experts, and the main thread's wait for the CPU result.
Overlap shows as a step shorter than CPU + GPU; `hidden` is the GPU time not added to the step.
Usage (GPU machine): python bench/hybrid_decode.py [--layers 4] [--gpu-experts 32]
[--steps 10] [--tokens 1 4 16] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import append_results  # noqa: E402
from glmflash.config import ModelConfig  # noqa: E402
from glmflash.engine.experts import (  # noqa: E402
    ExpertPlacement,
    hybrid_layers,
    place_experts,
    take_expert_times,
)
from glmflash.engine.model_runner import move_all_but_experts  # noqa: E402
from glmflash.model.moe import MoE  # noqa: E402


def _random_fill(module: torch.nn.Module) -> None:
    for name, p in module.named_parameters():
        if p.dtype == torch.float8_e4m3fn:  # random e4m3 bytes without NaN codes
            p.data.view(torch.uint8).copy_(torch.randint(0, 0x7E, p.shape, dtype=torch.uint8))
        elif name.endswith("weight_scale_inv"):
            p.data.uniform_(1e-4, 3e-4)
        else:
            p.data.normal_(0, 0.02)


def make_layers(num_layers: int) -> torch.nn.ModuleList:
    config = ModelConfig(num_hidden_layers=1, layer_types=("indexed_attention",),
                         indexer_types=("full",), mlp_layer_types=("sparse",))
    layers = torch.nn.ModuleList()
    for i in range(num_layers):
        layer = MoE(config, torch.bfloat16, fp8_block=128)
        if i == 0:
            _random_fill(layer)
        else:
            _random_fill(layer.gate)
            _random_fill(layer.shared_experts)
            for p, q in zip(layer.experts.parameters(), layers[0].experts.parameters(),
                            strict=True):
                p.data = q.data
        layers.append(layer)
    return layers


def step(layers: torch.nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = torch.nn.functional.normalize(x + layer(x), dim=-1) * 64
    return x


def measure(layers: torch.nn.ModuleList, tokens: int, steps: int) -> dict[str, float]:
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    step(layers, x)
    torch.cuda.synchronize()
    take_expert_times(layers)
    wall = 0.0
    for _ in range(steps):
        begin = time.perf_counter()
        step(layers, x)
        torch.cuda.synchronize()
        wall += time.perf_counter() - begin
    times = take_expert_times(layers)
    ms = lambda s: 1e3 * s / steps  # noqa: E731
    hidden = (times.cpu_s + times.gpu_s - wall) / times.gpu_s if times.gpu_s else 0.0
    return {"tokens": tokens, "step": ms(wall), "cpu": ms(times.cpu_s), "gpu": ms(times.gpu_s),
            "wait": ms(times.wait_s), "hidden": max(0.0, min(1.0, hidden))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu-experts", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    layers = make_layers(args.layers)
    device = torch.device("cuda")
    move_all_but_experts(layers, device)
    place_experts(layers, ExpertPlacement(args.gpu_experts), device)
    for layer in hybrid_layers(layers):
        layer.record_gpu_times = True
    rows = [f"| tokens | step ms ({args.layers} layers) | CPU experts ms | GPU ms (shared + "
            f"{args.gpu_experts} resident) | main-thread wait ms | GPU time hidden |",
            "|---|---|---|---|---|---|"]
    for tokens in args.tokens:
        r = measure(layers, tokens, args.steps)
        rows.append(f"| {r['tokens']} | {r['step']:.2f} | {r['cpu']:.2f} | {r['gpu']:.3f} | "
                    f"{r['wait']:.2f} | {r['hidden']:.0%} |")
    table = "\n".join(rows)
    print(table)
    if not args.no_append:
        append_results("Hybrid decode: CPU experts overlapped with the GPU "
                       "(bench/hybrid_decode.py)", table)


if __name__ == "__main__":
    main()
