"""Where a training step of the tiny model spends its GPU time: the CUDA kernels of one eager
step (fixed-shape batch, after the warm-up) by total time, then the replayed graph's step time.

    python -m bench.train_step_profile [--tokens-per-step 32768] [--top 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tools import tiny_graph_step
from tools.tiny_run import RunOptions, Training


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens-per-step", type=int, default=32768)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--replays", type=int, default=5)
    args = parser.parse_args()
    run = Training(RunOptions(tokens_per_step=args.tokens_per_step, device="cuda", workers=4,
                              graph=True), total_steps=1000)
    try:
        for _ in range(tiny_graph_step.WARMUP_STEPS):
            run.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            run._train_on(run.graph_step.inputs)
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        total = sum(e.self_device_time_total for e in events)
        print(f"| kernel | calls | ms | share |  (eager step: {total / 1e3:.1f} ms of kernels)")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.top]:
            print(f"| {e.key[:90]} | {e.count} | {e.self_device_time_total / 1e3:.2f} | "
                  f"{e.self_device_time_total / total:.1%} |")
        run.step()  # the capture
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.replays):
            run.step()
        torch.cuda.synchronize()
        print(f"| graph step | {(time.perf_counter() - start) / args.replays * 1e3:.1f} ms |")
    finally:
        run.close()


if __name__ == "__main__":
    main()
