"""Nsight Compute over bench/ncu_targets.py: one summary row per kernel (GPU only).

    python3 bench/ncu_profile.py [TARGET=REGEX[=COUNT] ...] [--out DIR]

Each TARGET (an ncu_targets.py target, e.g. `mla:8`) runs under `ncu --clock-control none`,
profiling the first COUNT launches (default 1) whose kernel name matches REGEX, with the
sections below; the raw metrics of every kernel go to DIR/ncu_raw.csv and one row per kernel
to stdout: duration, DRAM / SM / memory throughput (% of peak), the busiest tensor pipe,
registers, achieved occupancy, cycles between a warp's instructions and the stalls that take
most of them (cycles per issued instruction). Durations run ~10% above CUDA-graph timings
(clocks not locked, caches flushed before each kernel).
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "Occupancy", "WarpStateStats", "LaunchStats",
            "ComputeWorkloadAnalysis", "SchedulerStats")
DEFAULT_TARGETS = (
    "mla:8=sparse_mla=2", "mla:32=sparse_mla=2", "mla:4096=sparse_mla_kernel",
    "fp8:16:4096:4096=fp8_wdq|fp8_stream", "smm:16:4096:4096=nvjet|gemm|xmma|cutlass",
    "fp8:16:1536:16384=fp8_wdq|fp8_stream", "smm:16:1536:16384=nvjet|gemm|xmma|cutlass",
    "fp8:2048:4096:1536=fp8_act_quant|nvjet|gemm|xmma|cutlass=2",
    "smm:2048:4096:1536=nvjet|gemm|xmma|cutlass",
    "moe:8192=block_fp8_gemm=2", "idx:1048576:32=indexer_score|topk=6",
    "idx8:1048576:32=indexer_score=1",
)
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio")
TENSOR = re.compile(r"sm__pipe_tensor\w*_cycles_active\.avg\.pct_of_peak_sustained_active")


def profile(target: str, regex: str, count: int, log: Path) -> list[dict[str, str]]:
    cmd = ["ncu", "--clock-control", "none", "-k", f"regex:{regex}", "-c", str(count),
           "--page", "raw", "--csv", "--log-file", str(log)]
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, "bench/ncu_targets.py", target]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=300)
    lines = log.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.reader(lines[start:]))
    header, units = rows[0], rows[1]
    named = [{f"{h} [{u}]" if u else h: v for h, u, v in zip(header, units, row, strict=True)}
             for row in rows[2:]]
    return named


def value(row: dict[str, str], name: str) -> tuple[str, str]:
    """(value, unit) of the first column called `name`."""
    for key, v in row.items():
        if key == name or key.startswith(name + " ["):
            unit = key[len(name) + 2:-1] if key.startswith(name + " [") else ""
            return v, unit
    return "-", ""


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def summary(target: str, row: dict[str, str]) -> list[str]:
    time, unit = value(row, "gpu__time_duration.sum")
    us = number(time) * {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0,
                                "msecond": 1e3, "ms": 1e3}.get(unit, 1.0)
    by_name = {key.split(" [")[0]: v for key, v in row.items()}  # units dropped
    stalls = sorted(((number(v), match.group(1)) for name, v in by_name.items()
                     if (match := STALL.match(name))), reverse=True)
    tensor = max((number(v) for name, v in by_name.items() if TENSOR.match(name)), default=0.0)
    top = ", ".join(f"{name} {v:.1f}" for v, name in stalls[:4])
    return [target, row.get("Kernel Name", "?")[:40], f"{us:.1f}",
            value(row, "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed")[0],
            value(row, "lts__throughput.avg.pct_of_peak_sustained_elapsed")[0],
            value(row, "sm__throughput.avg.pct_of_peak_sustained_elapsed")[0],
            f"{tensor:.1f}", value(row, "launch__registers_per_thread")[0],
            value(row, "launch__grid_size")[0],
            value(row, "sm__warps_active.avg.pct_of_peak_sustained_active")[0],
            value(row, "smsp__average_warp_latency_per_inst_issued.ratio")[0], top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", default=list(DEFAULT_TARGETS))
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("| target | kernel | us | DRAM % | L2 % | SM % | tensor pipe % | regs | grid "
          "| occupancy % | cycles per issue | top stalls (cycles per issue) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    with open(out / "ncu_raw.csv", "w", newline="") as raw:
        for spec in args.targets:
            target, regex, *count = spec.split("=")
            try:
                rows = profile(target, regex, int(count[0]) if count else 1, out / "ncu.log")
            except (subprocess.SubprocessError, StopIteration) as exc:
                why = str(exc) or f"no kernel matched {regex!r}"
                print(f"| {target} | failed: {why} |", flush=True)
                continue
            for row in rows:
                print("| " + " | ".join(summary(target, row)) + " |", flush=True)
                csv.writer(raw).writerows([["target", target], *row.items()])


if __name__ == "__main__":
    main()
