"""Where a decode step of the tiny model goes: kernel launches, GPU busy time, wall time, and
the host operations and kernels that cost the most (torch.profiler).

Usage: python bench/profile_decode.py [--device cuda] [--batch 1] [--steps 5] [--top 25]
       [--release-layers N]   (a release-width model of N layers on dummy weights, bench/e2e.py)
       [--cprofile]           (Python functions by own time instead of torch.profiler)
       [--mtp RATE]           (speculative decoding, one draft accepted at the forced RATE,
                               as bench/e2e.py --mtp: the verify and draft graphs' kernels)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

from glmflash import Engine, SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--release-layers", type=int, default=0)
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--mtp", type=float, default=None)
    args = parser.parse_args()
    engine = make_engine(args)
    # Enough tokens for the warm-up and twice the timed steps at k + 1 tokens a step.
    params = SamplingParams(max_tokens=6 + 4 * args.steps + 16, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([5 + i, 17, 99, 3] * 8, params, lambda d: None)
    for _ in range(6):  # prefill and warm-up decodes (kernels compile)
        engine.step()
    if args.cprofile:
        profile_python(engine, args)
        return
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
    events = prof.events()
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    busy_ms = sum(e.time_range.end - e.time_range.start for e in kernels) / 1e3 / args.steps
    print("| batch | wall ms/step (profiled) | kernels/step | GPU busy ms/step |")
    print("|---|---|---|---|")
    print(f"| {args.batch} | {wall_ms:.2f} | {len(kernels) / args.steps:.0f} | {busy_ms:.2f} |")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top,
                                    max_name_column_width=60))
    if args.device == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.top,
                                        max_name_column_width=90))


def make_engine(args: argparse.Namespace) -> Engine:
    engine = _engine(args, _mtp_options(args) if args.mtp is not None else {})
    if args.mtp is not None:
        from bench.e2e_mtp import forced_acceptance

        engine.spec.accept_override = forced_acceptance(args.mtp)
    return engine


def _mtp_options(args: argparse.Namespace) -> dict:
    return dict(speculative_algorithm="NEXTN", speculative_num_steps=1,
                speculative_min_acceptance=0.0, disable_speculative_speed_check=True,
                cuda_graph_bs=[args.batch], speculative_max_batch_size=args.batch)


def _engine(args: argparse.Namespace, options: dict) -> Engine:
    if not args.release_layers:
        from glmflash.tiny.embedded import embedded_checkpoint, random_tiny_checkpoint

        # The trained model has an MTP layer; the random one none.
        folder = embedded_checkpoint() if options else random_tiny_checkpoint()
        return Engine(folder, device=args.device, context_length=512,
                      background_loop=False, **options)
    from bench.e2e import bench_config, write_folder

    folder = write_folder(bench_config(False, args.release_layers), Path(tempfile.mkdtemp()))
    return Engine(folder, device=args.device, load_format="dummy", context_length=512,
                  background_loop=False, **options)


def profile_python(engine: Engine, args: argparse.Namespace) -> None:
    """Wall time per step unprofiled, then the Python functions with the most own time."""
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall_ms = 1e3 * (time.perf_counter() - start) / args.steps
    print(f"batch {args.batch}: {wall_ms:.2f} ms per step unprofiled")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    stats.print_stats(args.top)


if __name__ == "__main__":
    main()
