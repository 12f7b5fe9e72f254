"""End-to-end benchmark: the real Engine at release width and reduced depth on dummy weights.

The real Engine (scheduler, runner, sampler, in-process) runs a full-width, reduced-depth
GLM-5.3-Flash with random weights made in memory (`load_format="dummy"`).
The model is the release config (tests/data/release_config.json) cut to `--layers` layers
(default 4: three KDA + one MLA, every layer MoE, no MTP, no vision tower), written with the
tiny tokenizer into a temporary folder that holds no weights. For each mode (all-gpu; hybrid-N:
N experts per layer resident on the GPU, the rest on the CPU kernel over all cores) it reports:
- decode tok/s and step ms at each batch and context; every sequence's context is faked
  (pages and state slot allocated, tokens counted as computed), so each timed step is a pure
  decode over that context;
- TTFT of a prompt of each context length (real chunked prefill; hybrid modes stream experts to
  the GPU for chunks of at least --layerwise-threshold tokens);
- CUDA kernel launches per layer in one decode step (torch.profiler, a range per layer), and
  the GPU busy time of that step; the CPU expert kernel's time per step;
- per-layer time (CUDA events at layer boundaries) for KDA and MLA layers, extrapolated to the
  release's 45 layers (34 KDA + 11 MLA);
- the roofline: bytes the step must move (model device: non-expert weights, the hit experts
  there, KV/state; CPU: the hit CPU experts) at the HBM copy and CPU read bandwidths measured
  in the same run, against the measured step.
The last line printed is `e2e_ratio=` roofline / measured for hybrid-0 at batch 1 (first context).

    python bench/e2e.py                       # H200: all modes, batches 1 4 16 32, 4K and 32K
    python bench/e2e.py --quick --modes hybrid-0
    python bench/e2e.py --tiny                # CPU smoke run on the tiny config (under 2 min)
    python bench/e2e.py --long-context        # 16K..1M: prefill, decode, ledger vs peak memory
    python bench/e2e.py --mtp                 # MTP speculative decoding on vs off (e2e_mtp.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import glmflash  # noqa: E402, F401  (sets the OpenMP spin policy before torch loads)
from bench import e2e_mtp  # noqa: E402
from bench.common import (  # noqa: E402
    add_fake_context_requests,
    append_results,
    copy_bandwidth,
    results_section,
)
from bench.e2e_long import decode_ratio_line, memory_line, reset_peak  # noqa: E402
from bench.e2e_probes import (  # noqa: E402
    CpuExpertClock,
    LayerProbe,
    cpu_read_gbs,
    profile_step,
    step_bytes,
)
from glmflash import Engine, SamplingParams  # noqa: E402
from glmflash.config import KDA, MLA  # noqa: E402
from glmflash.engine.options import INDEX_KEY_DTYPES, INDEX_QUERY_DTYPES  # noqa: E402
from glmflash.tiny.configs import tiny_config  # noqa: E402
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer  # noqa: E402

RELEASE_CONFIG = Path(__file__).resolve().parent.parent / "tests" / "data" / "release_config.json"
RELEASE_LAYERS = {KDA: 34, MLA: 11}
TITLE = "End-to-end engine at release width, reduced depth (bench/e2e.py)"
PRESETS = {
    "release": dict(batches=[1, 4, 16, 32], contexts=[4096, 32768], steps=16, warmup=3,
                    layer_steps=8, chunked_prefill_size=8192, probe_mb=1024),
    "quick": dict(batches=[1, 32], contexts=[4096], steps=8, warmup=2, layer_steps=4,
                  chunked_prefill_size=8192, probe_mb=1024),
    "tiny": dict(batches=[1, 4], contexts=[256, 1024], steps=8, warmup=2, layer_steps=4,
                 chunked_prefill_size=256, probe_mb=256),
    "long": dict(batches=[1], contexts=[16384, 131072, 524288, 1048576], steps=16, warmup=3,
                 layer_steps=4, chunked_prefill_size=8192, probe_mb=1024),
}


def bench_config(tiny: bool, num_layers: int) -> dict:
    """config.json of the bench model: every 4th layer MLA (at least one), all MoE, no vision."""
    raw = tiny_config("embedded") if tiny else json.loads(RELEASE_CONFIG.read_text())
    raw.pop("vision_config", None)
    text = raw["text_config"]
    kinds = [MLA if i % 4 == 3 else KDA for i in range(num_layers)]
    if MLA not in kinds:
        kinds[-1] = MLA
    text.update(num_hidden_layers=num_layers, layer_types=kinds,
                indexer_types=["full"] * num_layers, mlp_layer_types=["sparse"] * num_layers)
    linear = text.get("linear_attn_config") or {}
    if "kda_layers" in linear:
        linear["kda_layers"] = [i for i, k in enumerate(kinds) if k == KDA]
        linear["full_attn_layers"] = [i for i, k in enumerate(kinds) if k == MLA]
    return raw


def write_folder(raw: dict, root: Path) -> Path:
    """config.json plus the tiny tokenizer files: a checkpoint folder without weights."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(raw, indent=1))
    write_tiny_tokenizer(root)
    return root


def engine_options(mode: str, args: argparse.Namespace, num_experts: int) -> dict:
    longest = max(args.contexts) + args.warmup + args.steps + args.layer_steps + \
        args.replay_steps + 64
    mode, _, graphs = mode.partition("+")
    # The prefix cache is off: the TTFT prompts share their first tokens and must be cold.
    options = dict(load_format="dummy", background_loop=False, disable_radix_cache=True,
                   max_running_requests=max(args.batches), context_length=longest,
                   chunked_prefill_size=args.chunked_prefill_size,
                   disable_cuda_graph=graphs != "graph", cuda_graph_bs=args.batches,
                   index_key_dtype=args.index_key_dtype,
                   index_query_dtype=args.index_query_dtype)
    if mode.startswith("hybrid-"):
        options.update(kt_num_gpu_experts=min(int(mode.split("-", 1)[1]), num_experts),
                       kt_cpuinfer=os.cpu_count(),
                       kt_gpu_prefill_token_threshold=args.layerwise_threshold)
    return options


def prompt_ids(num_tokens: int) -> list[int]:
    return [1 + (7 * j) % 997 for j in range(num_tokens)]


def measure_ttft(engine: Engine, num_tokens: int) -> float:
    """Seconds from submitting a prompt of `num_tokens` to its first token (chunked prefill)."""
    deltas = []
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(prompt_ids(num_tokens), params, deltas.append)
    while not deltas:
        engine.step()
    seconds = time.perf_counter() - start
    while engine.scheduler.has_work:
        engine.step()
    return seconds


def measure_decode(engine: Engine, clock: CpuExpertClock, batch: int, context: int,
                   args: argparse.Namespace) -> dict:
    """Timed pure-decode steps of `batch` sequences at `context` tokens, then a pass with
    per-layer clocks and routing capture, then one profiled step."""
    total = args.warmup + args.steps + args.layer_steps + 1
    total += args.replay_steps + 1 if engine.runner.graphs is not None else 0
    params = SamplingParams(max_tokens=total, temperature=0, ignore_eos=True)
    seqs = add_fake_context_requests(engine, batch, context, params)
    for _ in range(args.warmup):
        engine.step()
    assert all(s.num_uncomputed_tokens == 1 for s in seqs), "a timed step would not be a decode"
    cpu_before, start = clock.seconds, time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    step_s = (time.perf_counter() - start) / args.steps
    cpu_ms = 1e3 * (clock.seconds - cpu_before) / args.steps
    model, graphs = engine.runner.model, engine.runner.graphs
    replay = timed_replays(engine, graphs, args.replay_steps) if graphs is not None else None
    # Layer clocks, routing and the per-layer launch count come from eager steps (hooks do not
    # run inside a replay).
    engine.runner.graphs = None
    with LayerProbe(model) as probe:
        start = time.perf_counter()
        for _ in range(args.layer_steps):
            engine.step()
        hooked_s = (time.perf_counter() - start) / args.layer_steps
    layer_ms, hits = probe.layer_ms(), probe.expert_hits()
    profile = profile_step(engine)
    engine.runner.graphs = graphs
    assert not engine.scheduler.has_work, "the decode sequences should all have finished"
    return dict(batch=batch, context=context, tok_s=batch / step_s, step_ms=1e3 * step_s,
                cpu_ms=cpu_ms, hooked_ms=1e3 * hooked_s, layer_ms=layer_ms, profile=profile,
                bytes=step_bytes(model, batch, context, hits), replay=replay)


def timed_replays(engine: Engine, graphs, steps: int) -> tuple[float, object]:
    """Mean GPU time of a replayed forward (CUDA events around it) over `steps` steps, and the
    profile of one more step: its kernels' summed time is what the replay is held against."""
    graphs.replay_events = []
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    times = [a.elapsed_time(b) for a, b in graphs.replay_events]
    graphs.replay_events = None
    return sum(times) / max(len(times), 1), profile_step(engine)


def run_mode(folder: Path, mode: str, args: argparse.Namespace, bandwidth: dict) -> list[dict]:
    device = "cpu" if mode == "cpu" else "cuda"
    num_experts = json.loads((folder / "config.json").read_text())["text_config"][
        "n_routed_experts"]
    engine = Engine(folder, device=device, dtype="float32" if device == "cpu" else "bfloat16",
                    **engine_options(mode, args, num_experts))
    clock = CpuExpertClock(engine.runner.model)
    long = args.long_context and engine.memory_ledger is not None and device == "cuda"
    if long:
        print(engine.memory_ledger.table(), flush=True)
    ttft = {}
    if not args.no_ttft:
        # Compile and warm the prefill path: two chunks, the second one continuing the first.
        measure_ttft(engine, min(args.chunked_prefill_size + 16, engine.max_seq_len - 2))
        for n in args.contexts:
            if long:
                reset_peak()
            ttft[n] = measure_ttft(engine, n)
            if long:
                print(f"{mode}: prefill of {n} tokens in {ttft[n]:.1f} s "
                      f"({n / ttft[n]:.0f} tokens/s); {memory_line(engine, 'prefill')}",
                      flush=True)
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            if long:
                reset_peak()
            row = measure_decode(engine, clock, batch, context, args)
            row.update(mode=mode, ttft=ttft.get(context) if batch == args.batches[0] else None)
            row.update(derive(row, engine, bandwidth, device))
            rows.append(row)
            print(format_row(row), flush=True)
            if long:
                print(f"{mode}: batch {batch} at {context}: {memory_line(engine, 'decode')}",
                      flush=True)
    clock.close()
    return rows


def derive(row: dict, engine: Engine, bandwidth: dict, device: str) -> dict:
    """Per-kind layer times, the 45-layer extrapolation and the roofline of a measured row."""
    kinds = engine.config.layer_types
    per_kind = {}
    for kind in (KDA, MLA):
        times = [t for t, k in zip(row["layer_ms"], kinds, strict=True) if k == kind]
        per_kind[kind] = sum(times) / len(times) if times else None
    mean = sum(row["layer_ms"]) / len(kinds)
    rest = row["hooked_ms"] - sum(row["layer_ms"])
    release = rest + sum(n * (per_kind[k] if per_kind[k] is not None else mean)
                         for k, n in RELEASE_LAYERS.items())
    # The hooked pass gives the proportions; the clean pass the step time they scale.
    release_ms = row["step_ms"] * release / row["hooked_ms"]
    device_bw = bandwidth["hbm"] if device == "cuda" else bandwidth["cpu"]
    roof_ms = 1e3 * (row["bytes"].device / device_bw + row["bytes"].cpu / bandwidth["cpu"]) / 1e9
    launches = {}
    kernels = row["profile"].kernels_per_layer
    for kind in (KDA, MLA):
        counts = [c for c, k in zip(kernels or [], kinds, strict=False) if k == kind]
        launches[kind] = sum(counts) / len(counts) if counts else None
    return dict(kda_ms=per_kind[KDA], mla_ms=per_kind[MLA], release_ms=release_ms,
                roof_ms=roof_ms, ratio=roof_ms / row["step_ms"], launches=launches)


HEADER = ("| mode | batch | context | TTFT s | decode tok/s | step ms | GPU busy ms | "
          "replay ms / its kernels ms (host ms) | "
          "CPU experts ms | launches/layer KDA / MLA | layer ms KDA / MLA | "
          "45-layer step ms (tok/s) | GB/step device + CPU | roofline ms | roofline / measured |")


def table_head() -> str:
    return HEADER + "\n" + "|---" * (HEADER.count(" | ") + 1) + "|"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _launches(row: dict, num_layers: int) -> str:
    profile = row["profile"]
    if not profile.num_kernels:
        return "-"
    whole = f"(step / layers {profile.num_kernels / num_layers:.0f})"
    if profile.kernels_per_layer is None:
        return whole
    return f"{_num(row['launches'][KDA], '.0f')} / {_num(row['launches'][MLA], '.0f')} {whole}"


def _replay(row: dict) -> str:
    """Graph rows: the replayed forward's GPU time, the summed time of the kernels of one
    replay, and the step's wall time not spent in the replay (host work not overlapped)."""
    if row.get("replay") is None:
        return "-"
    replay_ms, profile = row["replay"]
    return (f"{replay_ms:.2f} / {profile.gpu_busy_ms:.2f} "
            f"({row['step_ms'] - replay_ms:.2f})")


def format_row(row: dict) -> str:
    profile, nbytes = row["profile"], row["bytes"]
    busy = profile.gpu_busy_ms if profile.num_kernels else None
    cpu = row["cpu_ms"] if row["cpu_ms"] > 0 else None
    return (f"| {row['mode']} | {row['batch']} | {row['context']} | {_num(row['ttft'], '.2f')} | "
            f"{row['tok_s']:.1f} | {row['step_ms']:.2f} | {_num(busy, '.2f')} | "
            f"{_replay(row)} | "
            f"{_num(cpu, '.2f')} | {_launches(row, len(row['layer_ms']))} | "
            f"{_num(row['kda_ms'], '.2f')} / {_num(row['mla_ms'], '.2f')} | "
            f"{row['release_ms']:.1f} ({row['batch'] / row['release_ms'] * 1e3:.1f}) | "
            f"{nbytes.device / 1e9:.3g} + {nbytes.cpu / 1e9:.3g} | {row['roof_ms']:.3g} | "
            f"{row['ratio']:.3g} |")


def describe(config: dict, args: argparse.Namespace, bandwidth: dict, dtype: str) -> str:
    text = config["text_config"]
    kinds = text["layer_types"]
    hbm = f"HBM copy {bandwidth['hbm']:.0f} GB/s (read + write), " if bandwidth["hbm"] else ""
    return (f"{len(kinds)} layers ({kinds.count(KDA)} KDA + {kinds.count(MLA)} MLA, all MoE: "
            f"{text['n_routed_experts']} experts x {text['moe_intermediate_size']} "
            f"top-{text['num_experts_per_tok']}) at hidden {text['hidden_size']}, vocab "
            f"{text['vocab_size']}; load_format=dummy, {dtype}; chunked prefill "
            f"{args.chunked_prefill_size}; hybrid: CPU experts on {os.cpu_count()} threads, "
            f"layerwise prefill from {args.layerwise_threshold} tokens; {args.steps} timed "
            f"steps per point. Same run: {hbm}CPU read probe {bandwidth['cpu']:.1f} GB/s.\n\n"
            "45-layer: the step with each layer's measured time counted 34x (KDA) and 11x (MLA); "
            "every layer MoE (the release's first 3 are dense). +graph: decode replayed from "
            "CUDA graphs (layer clocks, launches and routing from eager steps). Roofline: the "
            "step's bytes "
            "(device: non-expert weights, the batch's embedding rows, experts hit there, KV and "
            "state, KDA state read and written; CPU: the CPU experts hit, FP8 + scales) at the "
            "bandwidths above, device and CPU in sequence.\n\n")


def e2e_ratio(rows: list[dict]) -> tuple[float, str]:
    ones = [r for r in rows if r["batch"] == min(r2["batch"] for r2 in rows)]
    chosen = next((r for r in ones if r["mode"] == "hybrid-0+graph"),
                  next((r for r in ones if r["mode"] == "hybrid-0"), ones[0]))
    return chosen["ratio"], (f"{chosen['mode']}, batch {chosen['batch']}, "
                             f"context {chosen['context']}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4, help="decoder layers (every 4th is MLA)")
    p.add_argument("--modes", nargs="+", default=None,
                   help="all-gpu, hybrid-N (N resident experts per layer), each with +graph "
                        "for CUDA-graph decode, or cpu; default: all-gpu hybrid-0 hybrid-32, "
                        "each with and without graphs, with CUDA, else cpu")
    p.add_argument("--batches", type=int, nargs="+", default=None)
    p.add_argument("--contexts", type=int, nargs="+", default=None,
                   help="decode contexts and TTFT prompt lengths (tokens)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point")
    p.add_argument("--replay-steps", type=int, default=8,
                   help="graph modes: steps whose replay is timed with CUDA events")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--layerwise-threshold", type=int, default=1024,
                   help="hybrid: prefill chunks of at least this many tokens stream experts")
    p.add_argument("--no-ttft", action="store_true", help="skip the TTFT prompts")
    p.add_argument("--quick", action="store_true", help="batches 1 32, context 4K, fewer steps")
    p.add_argument("--tiny", action="store_true", help="the tiny config (a CPU smoke run)")
    p.add_argument("--long-context", action="store_true",
                   help="contexts 16K 128K 512K 1M at batch 1, chunks of 8192: prefill time, "
                        "decode, the memory ledger and the peak allocated against it")
    p.add_argument("--index-key-dtype", default="auto", choices=INDEX_KEY_DTYPES,
                   help="the indexer's pooled keys (the engine option of the same name)")
    p.add_argument("--index-query-dtype", default="auto", choices=INDEX_QUERY_DTYPES,
                   help="the indexer's queries (the engine option of the same name)")
    p.add_argument("--append", action="store_true", help="append the table to bench/RESULTS.md")
    e2e_mtp.add_arguments(p)
    args = p.parse_args()
    args.reuse_given = args.reuse
    if args.mtp:
        args.batches = args.batches or [1, 4, 16]
        args.steps = args.steps or 48
        args.contexts = args.contexts or ([256] if args.tiny else [4096])
        args.modes = args.modes or (["all-gpu", "hybrid-0"] if torch.cuda.is_available()
                                    else ["cpu"])
    if args.batches:
        args.batches = sorted(args.batches)
    preset = PRESETS["tiny" if args.tiny else "quick" if args.quick else
                     "long" if args.long_context else "release"]
    for name, value in preset.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.modes is None and args.long_context and torch.cuda.is_available():
        args.modes = ["all-gpu+graph", "hybrid-0+graph"]
    if args.modes is None:
        args.modes = [m + g for m in ("all-gpu", "hybrid-0", "hybrid-32")
                      for g in ("", "+graph")] if torch.cuda.is_available() else ["cpu"]
    for mode in args.modes:
        base, _, graphs = mode.partition("+")
        valid = base in ("all-gpu", "cpu") or (base.startswith("hybrid-")
                                               and base[len("hybrid-"):].isdigit())
        if not valid or graphs not in ("", "graph") or (graphs and base == "cpu"):
            p.error(f"unknown mode {mode!r}: all-gpu, hybrid-N (each optionally +graph) or cpu")
        if mode != "cpu" and not torch.cuda.is_available():
            p.error(f"mode {mode} needs a CUDA device")
    return args


def main() -> None:
    args = parse_args()
    if args.mtp:
        depths = sorted({args.layers, args.fit_layers or args.layers})
        with tempfile.TemporaryDirectory(prefix="glmflash-e2e-") as tmp:
            folders = {d: write_folder(bench_config(args.tiny, d), Path(tmp) / str(d))
                       for d in depths}
            e2e_mtp.main(args, folders)
        return
    is_cuda = any(m != "cpu" for m in args.modes)
    bandwidth = {"hbm": copy_bandwidth() if is_cuda else None,
                 "cpu": cpu_read_gbs(args.probe_mb << 20)}
    if is_cuda:
        torch.cuda.empty_cache()
    config = bench_config(args.tiny, args.layers)
    print(table_head(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="glmflash-e2e-") as tmp:
        folder = write_folder(config, Path(tmp))
        for mode in args.modes:
            start = time.perf_counter()
            rows += run_mode(folder, mode, args, bandwidth)
            print(f"{mode}: {time.perf_counter() - start:.0f} s including the engine's start",
                  file=sys.stderr, flush=True)
            gc.collect()
            if is_cuda:
                torch.cuda.empty_cache()
    table = describe(config, args, bandwidth, "bfloat16" if is_cuda else "float32")
    table += table_head() + "\n" + "\n".join(format_row(r) for r in rows)
    title = TITLE + (" --tiny" if args.tiny else "")
    print(results_section(title, table))
    if args.append:
        append_results(title, table)
    if args.long_context:
        print(decode_ratio_line(rows))
    ratio, which = e2e_ratio(rows)
    print(f"e2e_ratio is roofline / measured for {which}")
    print(f"e2e_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
