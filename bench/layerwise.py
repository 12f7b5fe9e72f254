"""Layerwise prefill on the GPU: host-to-device expert streaming overlapped with MoE compute.

`--layers` layers at release width (288 experts, hidden 4096, width 2048, FP8 + block scales;
the layers share one 7.25 GB host buffer; issue 14's goal is read at 16). Reports pinned-copy
bandwidth measured in the same run, the streamer's achieved GB/s, the MoE compute alone, and how
much of the shorter side (transfer or compute) the pipeline hides.
Usage (GPU machine): python bench/layerwise.py [--tokens 2048] [--layers 16] [--no-append]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import append_results  # noqa: E402
from glmflash.config import ModelConfig  # noqa: E402
from glmflash.engine.experts import ExpertPlacement, place_experts  # noqa: E402
from glmflash.model.moe import Experts  # noqa: E402


def _release_moe_config() -> ModelConfig:
    return ModelConfig(num_hidden_layers=4, layer_types=("indexed_attention",) * 4,
                       indexer_types=("full",) * 4, mlp_layer_types=("sparse",) * 4)


def _make_layers(num_layers: int) -> list[Experts]:
    config = dataclasses.replace(_release_moe_config(), quant=None)
    layers = []
    shared = None
    for _ in range(num_layers):
        module = Experts(config, torch.bfloat16, fp8_block=128)
        if shared is None:
            for p in module.parameters():
                if p.dtype == torch.float32:
                    p.data.uniform_(1e-3, 2e-3)
                else:  # random e4m3 bytes without NaN codes
                    p.data.view(torch.uint8).copy_(torch.randint(0, 0x7E, p.shape,
                                                                 dtype=torch.uint8))
            shared = [p.data for p in module.parameters()]
        else:
            for p, data in zip(module.parameters(), shared, strict=True):
                p.data = data
        layers.append(module)
    return layers


def _sync() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def pinned_bandwidth(nbytes: int = 2 << 30) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host)
    start = _sync()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    return 3 * nbytes / (_sync() - start) / 1e9


def run(layers: list[Experts], tokens: int, mode: str) -> float:
    """Seconds for the MoE of all layers; mode: copy (transfer only), full (pipelined)."""
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 288, (tokens, 8), device="cuda")
    weights = torch.rand(tokens, 8, device="cuda")
    streamer = layers[0].backend.streamer
    start = _sync()
    for i, layer in enumerate(layers):
        if mode == "copy":
            streamer.acquire(i)
        else:
            layer(x, ids, weights)
    return _sync() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    layers = _make_layers(args.layers)
    model = torch.nn.ModuleList(layers)
    place_experts(model, ExpertPlacement(0, prefill_token_threshold=1), torch.device("cuda"))
    layer_bytes = sum(p.numel() * p.element_size() for p in layers[0].parameters())
    run(layers, 16, "full")  # warm up kernels and the slots
    copy_s = min(run(layers, args.tokens, "copy") for _ in range(2))
    full_s = min(run(layers, args.tokens, "full") for _ in range(2))
    # Compute alone: the slot already holds a layer, so time the expert loop without copies.
    slot = layers[0].backend.streamer.acquire(0)
    from glmflash.model.moe import grouped_experts
    x = torch.randn(args.tokens, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 288, (args.tokens, 8), device="cuda")
    w = torch.rand(args.tokens, 8, device="cuda")
    start = _sync()
    for _ in layers:
        grouped_experts(x, ids, w, slot, 10.0)
    compute_s = _sync() - start
    pinned = pinned_bandwidth()
    total_bytes = layer_bytes * len(layers)
    # Work that overlapped: what the two would take one after the other, less the pipeline.
    overlapped = max(0.0, copy_s + compute_s - full_s)
    shorter = min(copy_s, compute_s)
    rows = [
        "| what | value |", "|---|---|",
        f"| layers x bytes per layer | {len(layers)} x {layer_bytes / 1e9:.2f} GB |",
        f"| pinned host-to-device copy, same run | {pinned:.1f} GB/s |",
        f"| streamer transfer alone | {total_bytes / copy_s / 1e9:.1f} GB/s "
        f"({total_bytes / copy_s / 1e9 / pinned:.0%} of pinned) |",
        f"| MoE compute alone ({args.tokens} tokens, top-8) | {compute_s * 1e3:.0f} ms |",
        f"| pipelined transfer + compute | {full_s * 1e3:.0f} ms "
        f"(transfer {copy_s * 1e3:.0f} ms) |",
        f"| compute / transfer (goal <= 30%) | {compute_s / copy_s:.1%} |",
        f"| overlapped / the shorter of the two (all of it: 100%) | "
        f"{min(1.0, overlapped / shorter):.0%} |",
        f"| pipelined / the longer of the two (1.00: nothing added to it) | "
        f"{full_s / max(copy_s, compute_s):.3f} |",
    ]
    table = "\n".join(rows)
    print(table)
    if not args.no_append:
        append_results("Layerwise prefill streaming (bench/layerwise.py)", table)


if __name__ == "__main__":
    main()
