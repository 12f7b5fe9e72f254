"""Two CPU ranks (gloo) against one on the embedded model: decode step time and a prefill, after
start-up (issue 20's goal: two ranks within 2x the one-rank time; no pathological communication).

The one-rank engine uses every core; each of the two ranks gets half of them (the engine splits
the host's cores between its ranks), so the ratio shows what the split and its all-reduces cost.

    python bench/tp_cpu.py [--batch 8] [--steps 32] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from glmflash import Engine, SamplingParams  # noqa: E402

WARMUP_STEPS = 3


def measure(tp_size: int, args: argparse.Namespace) -> dict[str, float]:
    engine = Engine(device="cpu", tp_size=tp_size, background_loop=False)
    try:
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        engine.add_request([5 + j % 50 for j in range(args.prompt_len)], one, lambda d: None)
        start = time.perf_counter()
        while engine.scheduler.has_work or engine.num_pending:
            engine.step()
        prefill_s = time.perf_counter() - start
        params = SamplingParams(max_tokens=args.steps + WARMUP_STEPS + 1, temperature=0,
                                ignore_eos=True)
        for i in range(args.batch):
            engine.add_request([7 + (i + j) % 50 for j in range(16)], params, lambda d: None)
        for _ in range(1 + WARMUP_STEPS):  # the prefill of all, then warm decodes
            engine.step()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        step_ms = 1e3 * (time.perf_counter() - start) / args.steps
    finally:
        engine.shutdown()
    return {"tp": tp_size, "step_ms": step_ms, "tok_s": args.batch * 1e3 / step_ms,
            "prefill_s": prefill_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    args = p.parse_args()
    rows = [measure(tp, args) for tp in (1, 2)]
    print(f"embedded model, CPU, batch {args.batch} decode ({args.steps} steps), prefill of "
          f"{args.prompt_len} tokens")
    print("| ranks | decode step ms | decode tok/s | prefill s | step vs one rank |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} | {r['prefill_s']:.3f} | "
              f"{r['step_ms'] / rows[0]['step_ms']:.2f}x |")


if __name__ == "__main__":
    main()
