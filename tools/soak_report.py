"""The soak's report: what was measured, the goals it is held to, and its markdown table."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

from tools.soak_traffic import HOSTILE_KINDS, VALID_KINDS, Tally

HEALTH_P99_GOAL_S = 0.1
RSS_GROWTH_GOAL = 0.10


@dataclass
class Report:
    clients: int
    hostile: float
    minutes: float
    tally: Tally = field(default_factory=Tally)
    load_s: float = 0.0
    health_latencies: list[float] = field(default_factory=list)
    health_failures: list[str] = field(default_factory=list)
    rss_after_warmup: float = 0.0
    rss_peak: float = 0.0
    rss_end: float = 0.0
    idle_gauges: dict[str, float] = field(default_factory=dict)
    sigterm_streams: list[str] = field(default_factory=list)
    exit_code: int | None = None
    shutdown_s: float = 0.0
    has_traceback: bool = False
    integrity: str = "not reported"

    def read_log(self, text: str) -> None:
        self.has_traceback = "Traceback" in text
        found = re.search(r"cache integrity after shutdown: ok \((\d+) of (\d+) pages free\)",
                          text)
        if found:
            free, total = map(int, found.groups())
            self.integrity = "ok, all pages free" if free == total else \
                f"ok, {total - free} pages held"
        elif "cache integrity check failed" in text:
            self.integrity = "FAILED"

    @property
    def num_lost(self) -> int:
        return self.tally.count("LOST")

    @property
    def num_not_4xx(self) -> int:
        return self.tally.count("NOT_4XX")

    def as_dict(self, missed: list[str]) -> dict:
        outcomes = {f"{k}/{o}": n for (k, o), n in sorted(self.tally.outcomes.items())}
        return {"clients": self.clients, "hostile": self.hostile, "minutes": self.minutes,
                "load_s": self.load_s, "outcomes": outcomes, "lost": self.num_lost,
                "hostile_not_4xx": self.num_not_4xx,
                "latency_p50_s": percentile(self.tally.latencies, 50),
                "latency_p99_s": percentile(self.tally.latencies, 99),
                "health_p50_s": percentile(self.health_latencies, 50),
                "health_p99_s": percentile(self.health_latencies, 99),
                "health_max_s": max(self.health_latencies, default=0.0),
                "health_failures": self.health_failures[:20],
                "rss_mb": {"after_warmup": self.rss_after_warmup, "peak": self.rss_peak,
                           "end": self.rss_end},
                "idle_gauges": self.idle_gauges, "sigterm_streams": self.sigterm_streams,
                "exit_code": self.exit_code, "shutdown_s": self.shutdown_s,
                "traceback": self.has_traceback, "cache_integrity": self.integrity,
                "failures": self.tally.failures, "missed_goals": missed}


def percentile(values: list[float], pct: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * pct / 100))]


def check_goals(report: Report) -> list[str]:
    """Every goal the run missed, in words (empty: all met)."""
    checks = [
        (report.num_lost == 0, f"{report.num_lost} valid requests lost"),
        (report.num_not_4xx == 0, f"{report.num_not_4xx} hostile requests not answered 4xx"),
        (percentile(report.health_latencies, 99) < HEALTH_P99_GOAL_S,
         f"/health p99 {percentile(report.health_latencies, 99) * 1000:.0f} ms"),
        (not report.health_failures, f"{len(report.health_failures)} /health failures"),
        (report.rss_end <= report.rss_after_warmup * (1 + RSS_GROWTH_GOAL),
         f"RSS {report.rss_end:.0f} MB at the end vs {report.rss_after_warmup:.0f} after warm-up"),
        (not any(report.idle_gauges.values()), f"not idle after the load: {report.idle_gauges}"),
        (all(s in ("finished", "error event") for s in report.sigterm_streams),
         f"streams at SIGTERM: {report.sigterm_streams}"),
        (report.exit_code == 0, f"exit status {report.exit_code}"),
        (not report.has_traceback, "a traceback in the server log"),
        (report.integrity == "ok, all pages free", f"cache integrity: {report.integrity}"),
    ]
    return [message for ok, message in checks if not ok]


def markdown(report: Report, missed: list[str]) -> str:
    tally = report.tally
    by_kind: dict[str, list[str]] = {}
    for (kind, outcome), n in sorted(tally.outcomes.items()):
        by_kind.setdefault(kind, []).append(f"{outcome} {n}")
    num_valid = sum(n for (k, _), n in tally.outcomes.items() if k in VALID_KINDS)
    num_hostile = sum(n for (k, _), n in tally.outcomes.items() if k in HOSTILE_KINDS)
    num_actions = sum(tally.actions.values())
    hostile_share = sum(tally.actions[k] for k in HOSTILE_KINDS) / max(num_actions, 1)
    rows = [
        ("requests (all kinds)", str(sum(tally.outcomes.values()))),
        ("client actions, hostile share (a burst is one action)",
         f"{num_actions}, {hostile_share:.1%}"),
        *[(f"  {kind}", ", ".join(parts)) for kind, parts in by_kind.items()],
        ("valid requests lost (goal 0)", f"{report.num_lost} of {num_valid}"),
        ("hostile requests not 4xx (goal 0)", f"{report.num_not_4xx} of {num_hostile}"),
        ("valid request latency p50 / p99",
         f"{percentile(tally.latencies, 50):.2f} s / {percentile(tally.latencies, 99):.2f} s"),
        ("/health p50 / p99 / max (goal p99 < 100 ms)",
         " / ".join(f"{percentile(report.health_latencies, p) * 1000:.1f} ms" for p in (50, 99))
         + f" / {max(report.health_latencies, default=0) * 1000:.1f} ms"),
        ("RSS after warm-up / peak / end (goal end within 10%)",
         f"{report.rss_after_warmup:.0f} / {report.rss_peak:.0f} / {report.rss_end:.0f} MB"),
        ("cache after the load", "idle, all pages free" if not any(report.idle_gauges.values())
         else str(report.idle_gauges)),
        ("streams running at SIGTERM", ", ".join(report.sigterm_streams)),
        ("exit status, shutdown time, traceback", f"{report.exit_code}, "
         f"{report.shutdown_s:.1f} s, {'yes' if report.has_traceback else 'no'}"),
        ("cache integrity after shutdown", report.integrity),
        ("goals", "all met" if not missed else "MISSED: " + "; ".join(missed)),
    ]
    head = (f"\n## Soak: {report.minutes:g} min, {report.clients} clients, "
            f"{report.hostile:.0%} hostile (tools/soak.py)\n\n"
            f"{date.today()} · {_machine()} · commit {_commit()} · tiny checkpoint on CPU\n\n"
            "| what | value |\n|---|---|\n")
    return head + "".join(f"| {what} | {value} |\n" for what, value in rows)


def _machine() -> str:
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        count = Path("/proc/cpuinfo").read_text().count("processor\t:")
        return f"{cpu.group(1).strip()}, {count} cores" if cpu else "unknown CPU"
    except OSError:
        return "unknown CPU"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=Path(__file__).parent).stdout.strip() or "?"
    except OSError:
        return "?"
