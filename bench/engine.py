"""Engine throughput on the tiny model (CPU) and the host overhead per decode step.

Host overhead = step time minus model forward time: scheduling, batch preparation, sampling,
bookkeeping and detokenisation. Goal: < 1 ms per decode step at batch 32, the same at any context.
Usage: python bench/engine.py [--steps N] [--no-append]
       python bench/engine.py --contexts 4096,131072 --batch 32
With --contexts each of the batch's sequences starts with that much fake context (pages
allocated, no prefill), and the last line printed is `host_overhead_ms=<first>,<second>,...`.
--host-only replaces the network by a stub returning logits, so that step time is host work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import add_fake_context_requests, append_results  # noqa: E402
from glmflash import Engine, SamplingParams  # noqa: E402
from glmflash.config import ModelConfig  # noqa: E402
from glmflash.model.state import cache_bytes  # noqa: E402
from glmflash.tiny.embedded import random_tiny_checkpoint  # noqa: E402

WARMUP_STEPS = 3


class ForwardTimer:
    """Wraps the model call to accumulate its wall time (on a GPU, until its work is done, so
    that the rest of the step is the host's own work)."""

    def __init__(self, model) -> None:
        self.model, self.seconds = model, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.model(*args, **kwargs)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        self.seconds += time.perf_counter() - start
        return out


class StubModel:
    """Stands in for the network (--host-only): logits of the right shape on the model's
    device, so a step's time is the host's own work (schedule, prepare, sample, update, emit)."""

    def __init__(self, model) -> None:
        self.model = model
        self.vocab_size = model.config.vocab_size
        self.device = next(model.parameters()).device

    def __call__(self, batch, state, **kwargs):
        return torch.zeros(batch.logits_index.numel(), self.vocab_size, device=self.device)


def measure(engine: Engine, batch: int, steps: int, context: int = 16) -> dict[str, float]:
    """Decode `steps` steps of `batch` sequences that start with `context` tokens each."""
    params = SamplingParams(max_tokens=steps + 1 + WARMUP_STEPS, temperature=0, ignore_eos=True)
    if context > 16:
        add_fake_context_requests(engine, batch, context - 1, params)
    else:
        for i in range(batch):
            engine.add_request([5 + (i + j) % 50 for j in range(context)], params, lambda d: None)
    engine.step()  # prefill (or the first decode over the fake context) of everyone
    for _ in range(WARMUP_STEPS):  # kernels compile for this batch shape outside the timing
        engine.step()
    timer = ForwardTimer(engine.runner.model)
    engine.runner.model = timer
    graphs = engine.runner.graphs
    if graphs is not None:
        graphs.replay_events = []
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - start
    engine.runner.model = timer.model
    if graphs is not None:
        # Replayed steps: the model's time is the replays' GPU time (CUDA events around them).
        torch.cuda.synchronize()
        timer.seconds += sum(a.elapsed_time(b) for a, b in graphs.replay_events) / 1e3
        graphs.replay_events = None
    while engine.scheduler.has_work:
        engine.step()
    return {"batch": batch, "context": context, "tok_s": batch * steps / wall,
            "step_ms": 1e3 * wall / steps, "model_ms": 1e3 * timer.seconds / steps,
            "host_ms": 1e3 * (wall - timer.seconds) / steps}


def _table(rows: list[dict[str, float]]) -> str:
    table = ["| batch | context | decode tok/s | step ms | model ms | host overhead ms "
             "(goal < 1 at 32) |", "|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['context']} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | "
              f"{r['model_ms']:.2f} | {r['host_ms']:.3f} |" for r in rows]
    return "\n".join(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--contexts", default=None,
                        help="comma-separated fake context lengths (one batch size)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 on cuda)")
    parser.add_argument("--host-only", action="store_true",
                        help="replace the network by a stub: the step time is host work alone")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--disable-cuda-graph", action="store_true")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else None
    longest = max(contexts) if contexts else 512
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    # The random tiny checkpoint (hidden 192, 6 layers): the model of the recorded figures.
    folder = random_tiny_checkpoint()
    per_token, per_slot = cache_bytes(ModelConfig.from_hf(folder),
                                      getattr(torch, dtype))
    # Room for every sequence's whole context plus the decoded tokens.
    seqs = max(32, args.batch)
    budget = (seqs * (longest + args.steps + 128) * per_token + seqs * per_slot) / 2**30
    engine = Engine(folder, device=args.device, dtype=dtype,
                    max_running_requests=max(32, args.batch),
                    context_length=longest + args.steps + 64, cache_budget_gb=budget + 0.1,
                    background_loop=False, disable_cuda_graph=args.disable_cuda_graph)
    if args.host_only:
        engine.runner.model = StubModel(engine.runner.model)
    if contexts:
        rows = [measure(engine, args.batch, args.steps, c) for c in contexts]
    else:
        rows = [measure(engine, b, args.steps) for b in (1, 8, 32)]
    text = _table(rows)
    print(text)
    if not args.no_append:
        graphs = " (CUDA graphs)" if engine.runner.graphs is not None else ""
        append_results(f"Engine decode on the tiny model (bench/engine.py){graphs}", text)
    if contexts:
        print("host_overhead_ms=" + ",".join(f"{r['host_ms']:.3f}" for r in rows))


if __name__ == "__main__":
    main()
