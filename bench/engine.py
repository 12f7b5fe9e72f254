"""Engine throughput on the tiny model (CPU) and the host overhead per decode step.

Host overhead = step time minus model forward time: scheduling, batch preparation, sampling,
bookkeeping and detokenisation. Goal: < 1 ms per decode step at batch 32.
Usage: python bench/engine.py [--steps N] [--no-append]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import append_results  # noqa: E402
from glmflash import Engine, SamplingParams  # noqa: E402


class ForwardTimer:
    """Wraps the model call to accumulate its wall time."""

    def __init__(self, model) -> None:
        self.model, self.seconds = model, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        return out


def measure(engine: Engine, batch: int, steps: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + i % 50] * 16, params, lambda d: None)
    engine.step()  # prefill of everyone
    timer = ForwardTimer(engine.runner.model)
    engine.runner.model = timer
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    engine.runner.model = timer.model
    while engine.scheduler.has_work:
        engine.step()
    return {"batch": batch, "tok_s": batch * steps / wall, "step_ms": 1e3 * wall / steps,
            "model_ms": 1e3 * timer.seconds / steps,
            "host_ms": 1e3 * (wall - timer.seconds) / steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--no-append", action="store_true")
    args = parser.parse_args()
    engine = Engine(device="cpu", dtype="float32", max_running_requests=32, context_length=512,
                    background_loop=False)
    rows = [measure(engine, b, args.steps) for b in (1, 8, 32)]
    table = ["| batch | decode tok/s | step ms | model ms | host overhead ms (goal < 1 at 32) |",
             "|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {r['model_ms']:.2f} | "
              f"{r['host_ms']:.3f} |" for r in rows]
    text = "\n".join(table)
    print(text)
    if not args.no_append:
        append_results("Engine decode on the tiny model (bench/engine.py)", text)


if __name__ == "__main__":
    main()
