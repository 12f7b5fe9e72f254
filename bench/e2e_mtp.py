"""`bench/e2e.py --mtp`: decode tok/s with MTP speculative decoding on vs off, at release width
and reduced depth on dummy weights (the model of bench/e2e.py plus an MTP layer).

Random weights accept nothing and route without locality, so both are forced:
- acceptance: each draft is accepted with probability `--accept` (a chain: the first rejection
  ends it) and the accepted tokens are the target's own greedy tokens, so a step costs what a
  real one with that acceptance costs (verify of 1 + drafts tokens, MTP over the accepted
  positions, chained drafts);
- routing: inside a verify forward, each token of a sequence keeps `--reuse` of the previous
  token's experts (the rest its own choice), which is what decides the union of experts a verify
  step reads; the verify graphs are captured again once the override is in place. Decodes are
  not changed.
One engine per mode: MTP off is the same engine with drafting switched off (its decode steps
replay the CUDA graphs, and the MTP layer does not follow them); with MTP on, the verify and
draft forwards replay their graphs (engine/spec_graphs.py) whenever every sequence has its
drafts. Rows: the measured tok/s, and the estimate at the release's 45 layers (the main
forward's share scaled by 45 / layers, the MTP layer's time kept).

    python bench/e2e.py --mtp                           # H200: all-gpu and hybrid-0, < 2 min
    python bench/e2e.py --mtp --modes all-gpu --fit-layers 8    # and the 45-layer line
    python bench/e2e.py --mtp --tiny --modes cpu        # CPU smoke run
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from bench.common import add_fake_context_requests, copy_bandwidth
from bench.e2e_probes import cpu_read_gbs, moe_layers, step_bytes
from glmflash import Engine, SamplingParams
from glmflash.engine import spec_capture, spec_runner
from glmflash.model import verify
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Router

RELEASE_DEPTH = 45
VERIFY_BUILDERS = (spec_capture, spec_runner)
"""The engine modules that build verify batches (`verify.verify_batch`)."""


class ForcedRouting:
    """Routers of the main model keep `share` of the previous token's experts within each
    sequence of a verify forward."""

    def __init__(self, model: GlmForCausalLM, share: float) -> None:
        self.share, self.num_tokens = share, None
        self.model, self.hidden_states = model, model.hidden_states
        self.routers = [m for m in model.modules() if isinstance(m, Router)]
        self.forwards = [r.forward for r in self.routers]
        model.hidden_states = self._hidden_states
        for router, forward in zip(self.routers, self.forwards, strict=True):
            router.forward = self._routed(forward)
        # The verify batch keeps its rows per sequence on the device only; the host counts are
        # taken where the engine builds it.
        self.rows_of: dict[int, list[int]] = {}
        for module in VERIFY_BUILDERS:
            module.verify_batch = self._recording(verify.verify_batch)

    def close(self) -> None:
        self.model.hidden_states = self.hidden_states
        for router, forward in zip(self.routers, self.forwards, strict=True):
            router.forward = forward
        for module in VERIFY_BUILDERS:
            module.verify_batch = verify.verify_batch

    def _recording(self, build):
        def build_and_record(packed, num_tokens, *args):
            batch = build(packed, num_tokens, *args)
            self.rows_of[id(batch.verify)] = list(num_tokens)
            return batch
        return build_and_record

    def _hidden_states(self, batch, state, **kwargs):
        self.num_tokens = None if batch.verify is None else self.rows_of[id(batch.verify)]
        return self.hidden_states(batch, state, **kwargs)

    def _routed(self, forward):
        def route(x):
            ids, weights = forward(x)
            if self.num_tokens is not None and ids.shape[0] == sum(self.num_tokens):
                ids = reuse_experts(ids, self.num_tokens, self.share)
            return ids, weights
        return route


def reuse_experts(ids: torch.Tensor, num_tokens: list[int], share: float) -> torch.Tensor:
    """Row t of a sequence (its rows back to back, `num_tokens` each) takes the first
    round(share * k) experts of row t-1, then its own choices not among them. With equal
    counts (a replayed verify) only views and device ops are used, so it can be captured."""
    k = ids.shape[1]
    keep = round(share * k)
    if not keep:
        return ids
    if len(set(num_tokens)) == 1:
        rows = ids.view(len(num_tokens), num_tokens[0], k).clone()
        for j in range(1, num_tokens[0]):
            rows[:, j] = _keep_first(rows[:, j - 1, :keep], rows[:, j], k)
        return rows.view(-1, k)
    ids, starts = ids.clone(), np.cumsum([0, *num_tokens])[:-1]
    for j in range(1, max(num_tokens)):
        at = torch.tensor([s + j for s, n in zip(starts, num_tokens, strict=True) if n > j],
                          device=ids.device)
        ids[at] = _keep_first(ids[at - 1, :keep], ids[at], k)
    return ids


def _keep_first(kept: torch.Tensor, own: torch.Tensor, k: int) -> torch.Tensor:
    """`kept` experts, then `own`'s choices not among them, k in all."""
    is_new = ~(own[:, :, None] == kept[:, None, :]).any(-1)
    order = torch.argsort((~is_new).int(), dim=1, stable=True)
    return torch.cat([kept, own.gather(1, order)[:, : k - kept.shape[1]]], dim=1)


def forced_acceptance(rate: float, seed: int = 0):
    rng = random.Random(seed)

    def count(draft: list[int]) -> int:
        accepted = 0
        while accepted < len(draft) and rng.random() < rate:
            accepted += 1
        return accepted
    return count


def measure(engine: Engine, batch: int, context: int, steps: int, warmup: int) -> dict:
    """Output tokens per second over `steps` steps after `warmup`, the MTP layer's share, the
    GPU time of a replayed verify, and the GPU time in graphs a step (`gpu_ms`: decode replays,
    or the verify, acceptance and draft graphs; CUDA events around them, so no host time). The
    timed steps run untouched; the MTP layer's eager forwards are timed over as many further
    steps (`MtpClock` synchronises around each, which would slow the timed ones)."""
    params = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)
    seqs = add_fake_context_requests(engine, batch, context, params)
    for _ in range(warmup):
        engine.step()
    before = sum(s.num_output_tokens for s in seqs)
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    graphs = engine.spec.runner.graphs if engine.spec is not None else None
    collectors = [g for g in (graphs, engine.runner.graphs) if g is not None]
    for g in collectors:
        g.replay_events = []
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    seconds = time.perf_counter() - start
    tokens = sum(s.num_output_tokens for s in seqs) - before
    events = graphs.replay_events if graphs is not None else None
    gpu_ms = sum(e[0].elapsed_time(e[-1]) for g in collectors for e in g.replay_events) / steps
    for g in collectors:
        g.replay_events = None
    clock = MtpClock(engine)
    if engine.spec is not None and engine.spec.policy.max_batch_size:  # drafting on
        for _ in range(steps):
            engine.step()
    clock.close()
    for seq in seqs:
        engine.abort(engine._choices[seq.seq_id].request_id)
    engine.step()
    verify_ms = _mean_ms(events, 0, 1)
    graph_mtp_ms = _mean_ms(events, 1, 2) * len(events) / steps if events else 0.0
    return dict(tok_s=tokens / seconds, step_ms=1e3 * seconds / steps,
                mtp_ms=1e3 * clock.seconds / steps + graph_mtp_ms,
                tokens_per_step=tokens / steps / batch, verify_ms=verify_ms,
                graph_steps=len(events or []), gpu_ms=gpu_ms if collectors else None)


def _mean_ms(events, first: int, last: int) -> float | None:
    if not events:
        return None
    return sum(e[first].elapsed_time(e[last]) for e in events) / len(events)


def roofline_ms(engine: Engine, batch: int, rows: int, context: int, reuse: float,
                bandwidth: dict) -> float:
    """The bytes a forward of `rows` rows for each of `batch` sequences must move (a decode:
    1, a verify: 1 + drafts) at the copy bandwidths: the weights once, each row's cache reads,
    and the union of the rows' experts (each sequence's rows keep `reuse` of the previous row's
    experts; sequences route independently, uniformly)."""
    config, model = engine.config, engine.runner.model
    k, experts = config.num_experts_per_tok, config.n_routed_experts
    per_seq = k + (rows - 1) * (k - round(reuse * k))
    distinct = experts * (1 - (1 - per_seq / experts) ** batch)
    on_cpu = engine.options.kt_num_gpu_experts is not None
    hits = [(0.0, distinct) if on_cpu else (distinct, 0.0)] * len(moe_layers(model))
    moved = step_bytes(model, batch * rows, context, hits)
    return 1e3 * (moved.device / bandwidth["hbm"] + moved.cpu / bandwidth["cpu"]) / 1e9


def roofline_speedup(off: dict, on: dict) -> str:
    """MTP's speedup were both steps at their rooflines: tokens a step over the verify's bytes
    against the decode's (the MTP layer, its lm_head and the acceptance left out: a bound);
    "-" without a device bandwidth (the CPU smoke run)."""
    if not on["roof_ms"]:
        return "-"
    return f"{on['tokens_per_step'] * off['roof_ms'] / on['roof_ms']:.2f}x"


class MtpClock:
    """Wall time inside the MTP layer's forwards (synchronised around each)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds, self.spec = 0.0, engine.spec
        self.device = engine.device
        if self.spec is None:
            return
        runner = self.spec.runner
        self.originals = (runner.draft_extend, runner.draft_chain, runner.draft_verified,
                          runner.draft_in_graph)
        runner.draft_extend = self._timed(runner.draft_extend)
        runner.draft_chain = self._timed(runner.draft_chain)
        runner.draft_verified = self._timed(runner.draft_verified)
        runner.draft_in_graph = self._timed(runner.draft_in_graph)

    def _timed(self, fn):
        def call(*args, **kwargs):
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            return out
        return call

    def close(self) -> None:
        if self.spec is not None:
            runner = self.spec.runner
            (runner.draft_extend, runner.draft_chain, runner.draft_verified,
             runner.draft_in_graph) = self.originals


def release_tok_s(row: dict, batch: int, num_layers: int) -> float:
    """tok/s with the main forward scaled to 45 layers and the MTP layer's time kept."""
    main_ms = row["step_ms"] - row["mtp_ms"]
    step_ms = main_ms * RELEASE_DEPTH / num_layers + row["mtp_ms"]
    return row["tokens_per_step"] * batch / step_ms * 1e3


def fitted_tok_s(rows: dict[int, dict], batch: int) -> tuple[float, float]:
    """tok/s and step ms at 45 layers on the line through the step times at two depths
    (`rows`: depth -> `measure` dict): what does not grow with depth (lm_head, sampling,
    acceptance, host work, the MTP layer) is the line's intercept. Both depths keep every
    fourth layer MLA, so a 4-layer slope counts 33.75 KDA and 11.25 MLA layers at 45 (the
    release: 34 and 11)."""
    (d1, r1), (d2, r2) = sorted(rows.items())
    step = at_release_depth(r1["step_ms"], r2["step_ms"], d1, d2)
    tokens = (r1["tokens_per_step"] + r2["tokens_per_step"]) / 2
    return tokens * batch / step * 1e3, step


def at_release_depth(v1: float, v2: float, d1: int, d2: int) -> float:
    """The line through (d1, v1) and (d2, v2) at 45 layers."""
    return v1 + (v2 - v1) * (RELEASE_DEPTH - d1) / (d2 - d1)


FIT_HEADER = ("| mode | expert reuse | batch | forced acceptance | step ms off / on at the two "
              "depths | fixed ms off / on | per layer ms off / on | 45-layer step ms off / on | "
              "45-layer tok/s off / on | speedup | GPU ms in graphs off / on at the two depths | "
              "45-layer GPU ms off / on (speedup) | speedup at the rooflines |")


def fit_table(points: list[dict], depths: list[int]) -> list[str]:
    """The 45-layer line of each point measured at both depths."""
    by_key: dict[tuple, dict[int, dict]] = {}
    for depth, point in points:
        if point["on"] is not None:
            by_key.setdefault(point["key"], {})[depth] = point
    lines = []
    for (mode, reuse, batch, rate), at in by_key.items():
        if len(at) < 2:
            continue
        d1, d2 = sorted(at)
        off = {d: at[d]["off"] for d in (d1, d2)}
        on = {d: at[d]["on"] for d in (d1, d2)}
        (off_tok, off_ms), (on_tok, on_ms) = fitted_tok_s(off, batch), fitted_tok_s(on, batch)
        roofs = {name: at_release_depth(r[d1]["roof_ms"], r[d2]["roof_ms"], d1, d2)
                 for name, r in (("off", off), ("on", on))}
        bound = roofline_speedup({"roof_ms": roofs["off"]}, {
            "roof_ms": roofs["on"], "tokens_per_step": on[d1]["tokens_per_step"]})
        slope = [(r[d2]["step_ms"] - r[d1]["step_ms"]) / (d2 - d1) for r in (off, on)]
        fixed = [r[d1]["step_ms"] - d1 * k for r, k in zip((off, on), slope, strict=True)]
        steps = " / ".join(f"{d}: {off[d]['step_ms']:.2f} / {on[d]['step_ms']:.2f}"
                           for d in (d1, d2))
        lines.append(f"| {mode} | {reuse} | {batch} | {rate} | {steps} | {fixed[0]:.2f} / "
                     f"{fixed[1]:.2f} | {slope[0]:.3f} / {slope[1]:.3f} | {off_ms:.2f} / "
                     f"{on_ms:.2f} | {off_tok:.1f} / {on_tok:.1f} | {on_tok / off_tok:.2f}x | "
                     f"{_gpu_cells(off, on, d1, d2)} | {bound} |")
    return lines


def _gpu_cells(off: dict, on: dict, d1: int, d2: int) -> str:
    """The GPU time in graphs a step at both depths, and on its line at 45 layers with the
    speedup it gives (host work left out: steady, where the step times move with the host)."""
    if any(r[d]["gpu_ms"] is None for r in (off, on) for d in (d1, d2)):
        return "- | -"
    at = " / ".join(f"{d}: {off[d]['gpu_ms']:.2f} / {on[d]['gpu_ms']:.2f}" for d in (d1, d2))
    off_45, on_45 = (at_release_depth(r[d1]["gpu_ms"], r[d2]["gpu_ms"], d1, d2)
                     for r in (off, on))
    speedup = on[d1]["tokens_per_step"] * off_45 / on_45
    return f"{at} | {off_45:.2f} / {on_45:.2f} ({speedup:.2f}x)"


def run_mode(engine: Engine, mode: str, args: argparse.Namespace, deadline: float) -> list[dict]:
    """One measured point per (reuse, batch, acceptance): the MTP-off and MTP-on dicts of
    `measure` and the table row."""
    points = []
    spec = engine.spec
    num_layers = engine.config.num_hidden_layers
    for reuse in args.reuse:
        routing = ForcedRouting(engine.runner.model, reuse)
        recapture_spec_graphs(engine)
        try:
            for batch in args.batches:
                if time.perf_counter() > deadline:
                    points.append(dict(key=(mode, reuse, batch, None), off=None, on=None,
                                       line=f"| {num_layers} | {mode} | {reuse} | {batch} | "
                                            "(time limit) |"))
                    continue
                spec.policy.max_batch_size, spec.fills_held_off = 0, False
                off = measure(engine, batch, args.context, args.steps, args.warmup)
                off["roof_ms"] = roofline_ms(engine, batch, 1, args.context, reuse,
                                             args.bandwidth)
                spec.policy.max_batch_size, spec.fills_held_off = batch, True
                for rate in args.accept:
                    spec.accept_override = forced_acceptance(rate)
                    on = measure(engine, batch, args.context, args.steps, args.warmup)
                    on["roof_ms"] = roofline_ms(engine, batch, args.num_drafts + 1,
                                                args.context, reuse, args.bandwidth)
                    line = format_row(mode, reuse, batch, rate, off, on, num_layers)
                    points.append(dict(key=(mode, reuse, batch, rate), off=off, on=on, line=line))
                    print(line, flush=True)
                spec.accept_override = None
        finally:
            routing.close()
    return points


def recapture_spec_graphs(engine: Engine) -> None:
    """The verify graphs again, so that they hold the routing installed since their capture."""
    graphs = engine.spec.runner.graphs
    if graphs is not None:
        engine.spec.runner.capture_graphs(graphs.batch_sizes)


def format_row(mode, reuse, batch, rate, off, on, num_layers) -> str:
    off_45, on_45 = (release_tok_s(r, batch, num_layers) for r in (off, on))
    return (f"| {num_layers} | {mode} | {reuse} | {batch} | {rate} | {off['tok_s']:.1f} | "
            f"{on['tok_s']:.1f} | "
            f"{on['tok_s'] / off['tok_s']:.2f} | {on['tokens_per_step']:.2f} | "
            f"{off['step_ms']:.2f} / {on['step_ms']:.2f} | {on['mtp_ms']:.2f} | "
            f"{_verify_cell(on)} | {off_45:.1f} / {on_45:.1f} ({on_45 / off_45:.2f}x) | "
            f"{roofline_speedup(off, on)} |")


def _verify_cell(on: dict) -> str:
    if on["verify_ms"] is None:
        return "-"
    return (f"{on['verify_ms']:.2f} / {on['roof_ms']:.2f} ({on['verify_ms'] / on['roof_ms']:.2f}x,"
            f" {on['graph_steps']} replays)")


HEADER = ("| layers | mode | expert reuse | batch | forced acceptance | off tok/s | MTP tok/s | "
          "speedup | tokens/seq/step | step ms off / on | MTP layer ms/step | "
          "verify replay ms / roofline ms | 45-layer tok/s off / on | speedup at the rooflines |")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mtp", action="store_true",
                   help="decode tok/s with MTP speculative decoding on vs off (bench/e2e_mtp.py)")
    p.add_argument("--accept", type=float, nargs="+", default=[0.7],
                   help="--mtp: forced acceptance rates of each draft")
    p.add_argument("--reuse", type=float, nargs="+", default=None,
                   help="--mtp: share of the previous token's experts each token keeps "
                        "(default: 0 for all-gpu, 0 and 0.75 for hybrid)")
    p.add_argument("--num-drafts", type=int, default=1, help="--mtp: --speculative-num-steps")
    p.add_argument("--time-limit", type=float, default=100.0,
                   help="--mtp: seconds (per depth) after which the remaining points are skipped")
    p.add_argument("--fit-layers", type=int, default=None,
                   help="--mtp: a second depth; the 45-layer figures from the line through both")


def engine_options(mode: str, args: argparse.Namespace, context: int) -> dict:
    options = dict(load_format="dummy", background_loop=False, disable_radix_cache=True,
                   max_running_requests=max(args.batches), context_length=context + 4096,
                   speculative_algorithm="NEXTN", speculative_num_steps=args.num_drafts,
                   speculative_min_acceptance=0.0, disable_speculative_speed_check=True,
                   skip_kernel_warmup=mode == "cpu",
                   cuda_graph_bs=args.batches, speculative_max_batch_size=max(args.batches))
    if mode.startswith("hybrid-"):
        import os

        options.update(kt_num_gpu_experts=int(mode.split("-", 1)[1]), kt_cpuinfer=os.cpu_count())
    return options


def main(args: argparse.Namespace, folders: dict[int, object]) -> None:
    """Called by bench/e2e.py with its parsed arguments and the bench model's folder of each
    depth (one, or two with --fit-layers)."""
    deadline = time.perf_counter() + args.time_limit * len(folders)
    args.context = args.contexts[0]
    is_cuda = any(m != "cpu" for m in args.modes)
    args.bandwidth = {"hbm": copy_bandwidth() if is_cuda else float("inf"),
                      "cpu": cpu_read_gbs(args.probe_mb << 20)}
    if is_cuda:
        torch.cuda.empty_cache()
    print(f"HBM copy {args.bandwidth['hbm']:.0f} GB/s, CPU read {args.bandwidth['cpu']:.1f} GB/s",
          flush=True)
    print(HEADER + "\n" + "|---" * (HEADER.count(" | ") + 1) + "|", flush=True)
    points = []
    for depth, folder in sorted(folders.items()):
        for mode in args.modes:
            mode = mode.partition("+")[0]
            device = "cpu" if mode == "cpu" else "cuda"
            engine = Engine(folder, device=device,
                            dtype="float32" if device == "cpu" else "bfloat16",
                            **engine_options(mode, args, args.context))
            args.reuse = args.reuse_given or ([0.0] if mode in ("all-gpu", "cpu")
                                              else [0.0, 0.75])
            try:
                points += [(depth, p) for p in run_mode(engine, mode, args, deadline)]
            finally:
                engine.shutdown()
                del engine
                if device == "cuda":
                    torch.cuda.empty_cache()
    print("\n" + HEADER + "\n" + "|---" * (HEADER.count(" | ") + 1) + "|\n"
          + "\n".join(p["line"] for _, p in points))
    if len(folders) > 1:
        print("\n45 layers on the line through the step times at "
              + " and ".join(str(d) for d in sorted(folders)) + " layers:\n\n" + FIT_HEADER
              + "\n" + "|---" * (FIT_HEADER.count(" | ") + 1) + "|\n"
              + "\n".join(fit_table(points, sorted(folders))))
