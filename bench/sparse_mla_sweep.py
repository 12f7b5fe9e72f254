"""Sparse MLA candidates side by side: decode at 1, 8 and 32 queries and a 4096-query prefill,
each candidate configuration next to the current default, the default before the 1828f52 sweep,
and the roofline (one table).

    PYTHONPATH=. python bench/sweeps.py --ops mla          (or: python bench/sparse_mla_sweep.py)
    PYTHONPATH=. python bench/sparse_mla_sweep.py --candidates "default,old default"

Inputs, roofline and timing are bench/sparse_mla.py's (CUDA-graph replays, decode slot sets
rotated past L2). Decode candidates run at the decode sizes, prefill candidates at 4096.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import bf16_peak_tflops, copy_bandwidth, graph_ms, table  # noqa: E402
from bench.sparse_mla import (  # noqa: E402
    DECODE_QUERIES,
    PREFILL_QUERIES,
    mla_inputs,
    roofline,
    rotated_slots,
    time_config,
)


def old_default():
    """The default before the 1828f52 sweep: whole 64-slot steps over the tail, at least two
    steps per split, fp32 partials, prefill without a narrower tail."""
    from glmflash.kernels.sparse_mla.plan import SparseMlaConfig, SparseMlaLaunch

    return SparseMlaConfig(prefill=(SparseMlaLaunch(64, 3), SparseMlaLaunch(64, 2),
                                    SparseMlaLaunch(32, 2), SparseMlaLaunch(16, 2)),
                           decode=(SparseMlaLaunch(64, 2), SparseMlaLaunch(32, 2),
                                   SparseMlaLaunch(16, 2)),
                           min_split_steps=2, partial_dtype=torch.float32)


def gluon_candidates() -> dict[str, object]:
    """The warp-specialised Gluon form (SM90): its default (persistent), half a wave of
    splits, and a program per work item."""
    from glmflash.kernels.sparse_mla.gluon_sm90 import GLUON_SPARSE_MLA_CONFIG as G

    return {"gluon": G, "gluon half a wave": dataclasses.replace(G, waves=0.5),
            "gluon a program per item": dataclasses.replace(G, persistent=False)}


def decode_candidates() -> dict[str, object]:
    """Split-launch configurations around the default: partial precision, split length, slot
    steps and pipeline depth, fewer programs."""
    from glmflash.kernels.sparse_mla.plan import DEFAULT_CONFIG, SparseMlaLaunch

    def decode(*shapes, **changes):
        return dataclasses.replace(DEFAULT_CONFIG, decode=shapes or DEFAULT_CONFIG.decode,
                                   **changes)

    return {
        "default": DEFAULT_CONFIG,
        **gluon_candidates(),
        "old default": old_default(),
        "fp32 partials": decode(partial_dtype=torch.float32),
        "2-step splits": decode(min_split_steps=2),
        "half a wave": decode(waves=0.5),
        "3 stages": decode(SparseMlaLaunch(64, 3, tail_slots=16)),
        "32-slot steps 4 stages": decode(SparseMlaLaunch(32, 4, tail_slots=16)),
        "combine 2K tiles": decode(combine_elements=2048),
        "combine 16K tiles": decode(combine_elements=16384),
    }


def prefill_candidates() -> dict[str, object]:
    """Unsplit launch shapes: slot steps, pipeline depth, tail width."""
    from glmflash.kernels.sparse_mla.plan import DEFAULT_CONFIG, SparseMlaLaunch

    def prefill(shape):
        return dataclasses.replace(DEFAULT_CONFIG, prefill=(shape,))

    return {
        "default": DEFAULT_CONFIG,
        **gluon_candidates(),
        "old default": old_default(),
        "2 stages": prefill(SparseMlaLaunch(64, 2, tail_slots=16)),
        "32-slot steps 5 stages": prefill(SparseMlaLaunch(32, 5, tail_slots=16)),
    }


def candidates(queries: int, names: tuple[str, ...] | None = None) -> dict[str, object]:
    """The candidates at this size, only `names` if given."""
    found = decode_candidates() if queries <= DECODE_QUERIES[-1] else prefill_candidates()
    return {name: config for name, config in found.items() if names is None or name in names}


def _compile(queries: int, name: str) -> str:
    """Compile one candidate at one size into Triton's cache (a worker process): the launch's
    specialisation depends on the shapes, not on the cache size, so a small latent does."""
    from bench.sparse_mla import run_config

    q = torch.randn(queries, 64, 512, device="cuda").bfloat16()
    latent = torch.randn(4096, 512, device="cuda").bfloat16()
    slots = torch.randint(0, 4096, (queries, 2051), device="cuda")
    try:
        run_config(q, latent, slots, candidates(queries)[name], None)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the timing loop reports it
        return f"{queries} {name}: {type(e).__name__}"
    return ""


def precompile(wanted: tuple[str, ...] | None, workers: int = 8) -> None:
    """Every candidate (of `wanted`) compiled in parallel processes before the timing."""
    sizes = DECODE_QUERIES + (PREFILL_QUERIES,)
    queries = [size for size in sizes for _ in candidates(size, wanted)]
    names = [name for size in sizes for name in candidates(size, wanted)]
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        for failed in pool.map(_compile, queries, names):
            if failed:
                print(f"compile: {failed}", flush=True)


def sweep(parallel_compile: bool = True, names: tuple[str, ...] | None = None) -> str:
    """The table of `names` (None: every candidate); the first row of a size is the ratio's
    base (the default, when run)."""
    from glmflash.kernels.sparse_mla import sparse_mla_ref
    from glmflash.kernels.sparse_mla import triton_impl as ti

    start = time.time()
    if parallel_compile:
        precompile(names)
        print(f"compiled in {time.time() - start:.0f} s", flush=True)
    copy_gbs, peak = copy_bandwidth(), bf16_peak_tflops()
    print(f"copy {copy_gbs:.0f} GB/s, bf16 peak {peak:.0f} TFLOP/s", flush=True)
    rows = []
    for queries in DECODE_QUERIES + (PREFILL_QUERIES,):
        q, latent, slots, owner = mla_inputs(queries)
        moved, roof_ms = roofline(queries, q, slots, copy_gbs, peak)
        slot_sets = rotated_slots(slots, owner, moved)
        want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
        default_ms = None
        for name, config in candidates(queries, names).items():
            ms, err, how = time_config(q, latent, slot_sets, want, config)
            merge_us = combine_us(q, latent, slot_sets[0], config) if ms else None
            default_ms = default_ms or ms
            rows.append([queries, name, how, f"{ms * 1e3:.1f}" if ms else "-",
                         f"{default_ms / ms:.2f}x" if ms else "-",
                         f"{4 * queries * q.shape[1] * slots.shape[1] * q.shape[2] / ms / 1e9:.0f}"
                         if ms else "-", f"{roof_ms * 1e3:.1f}",
                         f"{100 * roof_ms / ms:.0f}%" if ms else "-", err,
                         f"{merge_us:.1f}" if merge_us else "-"])
            print(rows[-1], f"({time.time() - start:.0f} s)", flush=True)
        del q, latent, slots, slot_sets, want
        torch.cuda.empty_cache()
    ti._FITTED.clear()  # fits found for the swept configurations
    return table(["queries", "candidate", "launch", "us (graph)", "vs default", "TFLOP/s",
                  "roofline us", "% of roofline", "rel err vs fp32 ref", "combine us"], rows)


def combine_us(q, latent, slots, config) -> float | None:
    """The combine launch alone (CUDA-graph replays) on partials the attention launch just
    wrote, as in a forward; None when the launch is not split."""
    from bench.sparse_mla import launch_split, make_workspace, run_config
    from glmflash.kernels.sparse_mla.combine_triton import combine

    workspace = make_workspace(q, config)
    out = run_config(q, latent, slots, config, workspace)
    splits, merge, _ = launch_split(q, slots, config, workspace)
    if splits == 1:
        return None
    return graph_ms([lambda: combine(workspace, out, splits, merge)]) * 1e3


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", default=None,
                        help="candidate names, comma-separated (default: all)")
    args = parser.parse_args()
    wanted = tuple(args.candidates.split(",")) if args.candidates else None
    unknown = set(wanted or ()) - set(decode_candidates()) - set(prefill_candidates())
    if unknown:
        parser.error(f"unknown candidates: {', '.join(sorted(unknown))}")
    print(sweep(names=wanted))
