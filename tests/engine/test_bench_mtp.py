"""bench/e2e.py --mtp on the tiny model: the forced routing reaches the verify forwards (the
bench reads the rows of each sequence where the engine builds a verify batch)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from bench.e2e_mtp import reuse_experts

ROOT = Path(__file__).resolve().parents[2]


def test_reuse_keeps_the_previous_rows_experts():
    ids = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 6], [7, 8, 9, 10]])
    got = reuse_experts(ids, [2, 1], 0.5)
    # Row 1 (second of sequence 0) keeps row 0's first two experts, then its own new ones;
    # row 2 starts sequence 1 and keeps its own.
    assert got.tolist() == [[0, 1, 2, 3], [0, 1, 4, 5], [7, 8, 9, 10]]


def test_mtp_bench_runs_with_expert_reuse_on_the_cpu():
    run = subprocess.run(
        [sys.executable, "bench/e2e.py", "--mtp", "--tiny", "--modes", "cpu", "--batches", "1",
         "2", "--reuse", "0.5", "--num-drafts", "2"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 4 | cpu | 0.5 |")]
    assert len(rows) == 4, run.stdout  # each batch once as measured, once in the final table
