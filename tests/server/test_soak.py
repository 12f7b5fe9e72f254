"""The soak (tools/soak.py), short: a real `glmflash serve` under a mixed load with hostile
traffic, disconnects, aborts and bursts, then SIGTERM. The 10-minute run and its figures are in
bench/RESULTS.md; here the same goals on one minute of 8 clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# NOTE: the CI machine is shared; /health is held to 4x the soak's goal of 100 ms here.
CI_HEALTH_P99_S = 0.4


@pytest.mark.slow
def test_a_short_soak_meets_the_goals(tiny_dirs, tmp_path):
    report_path = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "soak.py"), "--minutes", "1", "--clients", "8",
         "--warmup-s", "10", "--model-path", str(tiny_dirs["embedded"]),
         "--log", str(tmp_path / "server.log"), "--json", str(report_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert report_path.exists(), proc.stdout + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["lost"] == 0, report["failures"]
    assert report["hostile_not_4xx"] == 0, report["failures"]
    assert sum(n for k, n in report["outcomes"].items() if k.startswith("hostile/")) > 0
    assert not report["health_failures"] and report["health_p99_s"] < CI_HEALTH_P99_S
    rss = report["rss_mb"]
    assert rss["end"] <= 1.1 * rss["after_warmup"], rss
    assert report["exit_code"] == 0 and not report["traceback"]
    assert report["cache_integrity"] == "ok, all pages free"
    assert set(report["sigterm_streams"]) <= {"finished", "error event"}
    assert not any(report["idle_gauges"].values())
