"""Where a decode step of the tiny model goes: kernel launches, GPU busy time, wall time, and
the host operations and kernels that cost the most (torch.profiler).

Usage: python bench/profile_decode.py [--device cuda] [--batch 1] [--steps 5] [--top 25]
"""

from __future__ import annotations

import argparse
import sys
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
    args = parser.parse_args()
    engine = Engine(device=args.device, context_length=512, background_loop=False)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request([5 + i, 17, 99, 3] * 8, params, lambda d: None)
    for _ in range(6):  # prefill and warm-up decodes (kernels compile)
        engine.step()
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
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main()
