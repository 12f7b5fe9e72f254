"""TTFT of turn 2 of a conversation, prefix cache on vs off (goal: warm >= 10x lower at 64K).

Turn 1 is a prompt of `context` tokens; turn 2 is the same prompt plus `--new-tokens` tokens
(the next user message). With the cache off, turn 2 is computed from its start; with it on,
turn 2 starts from the snapshot taken at the end of turn 1's prompt and computes only the new
tokens. Each context uses its own random prefix, so no context hits another's. Per context it
prints: TTFT of turn 1 (cold, cache on: includes taking the snapshot), turn 2 with the cache off,
turn 2 with it on (warm), the cached tokens and the speed-up off / warm. Timings include
everything the engine does per step (scheduling, snapshot and page copies).

    python bench/prefix_cache.py                      # CPU, tiny model, 4K 32K 64K
    python bench/prefix_cache.py --device cuda        # H200: release width, 4 layers
    python bench/prefix_cache.py --quick              # CPU smoke run: 1K and 4K
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import glmflash  # noqa: E402, F401  (sets the OpenMP spin policy before torch loads)
from bench.common import append_results  # noqa: E402
from bench.e2e import bench_config, write_folder  # noqa: E402
from glmflash import Engine, SamplingParams  # noqa: E402

TITLE = "Prefix cache: TTFT of turn 2, cache on vs off (bench/prefix_cache.py)"
FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 65536])
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4,
                        help="cuda: depth of the release-width dummy model")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="default 2048 on cpu, 8192 on cuda")
    parser.add_argument("--quick", action="store_true", help="contexts 1024 4096")
    parser.add_argument("--record", action="store_true", help="append to bench/RESULTS.md")
    args = parser.parse_args()
    if args.quick:
        args.contexts = [1024, 4096]
    if args.chunked_prefill_size is None:
        args.chunked_prefill_size = 8192 if args.device == "cuda" else 2048
    return args


def make_engine(args: argparse.Namespace, folder: Path | None, use_cache: bool) -> Engine:
    options = dict(background_loop=False, max_running_requests=2,
                   context_length=max(args.contexts) + args.new_tokens + 16,
                   chunked_prefill_size=args.chunked_prefill_size,
                   disable_radix_cache=not use_cache)
    if args.device == "cuda":
        return Engine(folder, device="cuda", dtype="bfloat16", load_format="dummy", **options)
    return Engine(device="cpu", dtype="float32", cache_budget_gb=4.0, **options)


def tokens(num_tokens: int, seed: int, vocab: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1, min(vocab, 100000), (num_tokens,), generator=generator).tolist()


def ttft(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, cached tokens) of one request, run to its end."""
    deltas = []
    start = time.perf_counter()
    engine.add_request(prompt, FIRST_TOKEN, deltas.append)
    while not deltas:
        engine.step()
    seconds = time.perf_counter() - start
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    while engine.scheduler.has_work:
        engine.step()
    return seconds, deltas[-1].num_cached_tokens


def run(args: argparse.Namespace, folder: Path | None, use_cache: bool) -> dict[int, dict]:
    engine = make_engine(args, folder, use_cache)
    vocab = engine.config.vocab_size
    ttft(engine, tokens(args.chunked_prefill_size + 64, seed=1, vocab=vocab))  # warm-up
    rows = {}
    for context in args.contexts:
        prefix = tokens(context, seed=context, vocab=vocab)
        turn2 = prefix + tokens(args.new_tokens, seed=context + 1, vocab=vocab)
        # With the cache off, turn 1 changes nothing for turn 2: it is not run.
        first = ttft(engine, prefix)[0] if use_cache else float("nan")
        second, cached = ttft(engine, turn2)
        rows[context] = dict(turn1=first, turn2=second, cached=cached)
        print(f"cache {'on ' if use_cache else 'off'} context {context}: turn 1 {first:.3f} s, "
              f"turn 2 {second:.3f} s ({cached} cached)", flush=True)
    del engine
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rows


def table(off: dict[int, dict], on: dict[int, dict], args: argparse.Namespace) -> str:
    lines = [f"turn 2 = turn 1 + {args.new_tokens} new tokens; chunked prefill "
             f"{args.chunked_prefill_size}", "",
             "| shared prefix | turn 1 cold, cache on (s) | turn 2, cache off (s) | "
             "turn 2, cache on (s) | cached tokens | off / on |",
             "|---|---|---|---|---|---|"]
    for context in args.contexts:
        a, b = off[context], on[context]
        lines.append(f"| {context} | {b['turn1']:.3f} | {a['turn2']:.3f} | {b['turn2']:.3f} | "
                     f"{b['cached']} | {a['turn2'] / b['turn2']:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = None
        if args.device == "cuda":
            folder = write_folder(bench_config(tiny=False, num_layers=args.layers), Path(tmp))
        off = run(args, folder, use_cache=False)
        on = run(args, folder, use_cache=True)
    text = table(off, on, args)
    print(text)
    if args.record:
        model = "tiny model" if args.device == "cpu" else \
            f"release width, {args.layers} layers, dummy weights"
        append_results(f"{TITLE}, {model}", text)


if __name__ == "__main__":
    main()
