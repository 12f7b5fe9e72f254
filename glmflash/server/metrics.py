"""Server metrics in the Prometheus text exposition format (version 0.0.4), no dependency.

Counters and histograms are updated on the event loop thread only; gauges come from the engine's
latest stats snapshot (`Engine.stats()`, taken on the engine thread) when /metrics is scraped.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0,
                     2.5, 5.0, 7.5, 10.0, 30.0, 60.0)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    pairs += [extra] if extra else []
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help: str, label_names: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help, label_names
        self.values: dict[tuple[str, ...], float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, *label_values: str) -> None:
        self.values[label_values] = self.values.get(label_values, 0.0) + amount

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for values, total in sorted(self.values.items()):
            lines.append(f"{self.name}{_labels(self.label_names, values)} {_number(total)}")
        return lines


class Gauge:
    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]) -> None:
        self.name, self.help, self.read = name, help, read

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}",
                f"{self.name} {_number(self.read())}"]


class CounterView(Gauge):
    """A counter kept by its owner (the engine) and read when /metrics is scraped."""

    kind = "counter"


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` samples of `value` (a gap shared by several tokens: one sample each)."""
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times

    @property
    def count(self) -> int:
        return sum(self.counts)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines += [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]
        return lines


class ServerMetrics:
    """Everything /metrics reports."""

    def __init__(self, engine: Engine) -> None:
        self.requests = Counter("glmflash_requests_total", "HTTP requests by route and status.",
                                ("route", "status"))
        self.prompt_tokens = Counter("glmflash_prompt_tokens_total", "Prompt tokens processed.")
        self.completion_tokens = Counter("glmflash_completion_tokens_total",
                                         "Completion tokens generated.")
        self.time_to_first_token = Histogram("glmflash_time_to_first_token_seconds",
                                             "Submission to first output token, per choice.")
        self.inter_token_latency = Histogram("glmflash_inter_token_latency_seconds",
                                             "Time between output tokens of one choice.")
        self.e2e_latency = Histogram("glmflash_e2e_request_latency_seconds",
                                     "Submission to the end of the last choice.")
        gauges = [
            Gauge("glmflash_num_queued_requests", "Choices waiting for admission.",
                  lambda: engine.stats().num_queued),
            Gauge("glmflash_num_running_requests", "Choices being generated.",
                  lambda: engine.stats().num_running),
            Gauge("glmflash_cache_usage_fraction", "Fraction of cache pages in use.",
                  lambda: engine.stats().cache_usage),
            *_prefix_cache_metrics(engine),
            *_speculative_metrics(engine),
        ]
        self._all = [self.requests, self.prompt_tokens, self.completion_tokens, *gauges,
                     self.time_to_first_token, self.inter_token_latency, self.e2e_latency]

    def render(self) -> str:
        return "\n".join(line for metric in self._all for line in metric.render()) + "\n"


def _prefix_cache_metrics(engine: Engine) -> list[Gauge]:
    """Hit rate, cached pages and snapshots of the prefix cache, from the engine's counters."""
    def stats():
        return engine.stats().prefix_cache

    def hit_rate() -> float:
        now = stats()
        return now.num_hit_tokens / now.num_query_tokens if now.num_query_tokens else 0.0

    return [
        CounterView("glmflash_prefix_cache_query_tokens_total",
                    "Prompt tokens of admitted requests.", lambda: stats().num_query_tokens),
        CounterView("glmflash_prefix_cache_hit_tokens_total",
                    "Prompt tokens taken from the prefix cache.", lambda: stats().num_hit_tokens),
        Gauge("glmflash_prefix_cache_hit_rate",
              "Fraction of admitted prompt tokens taken from the prefix cache.", hit_rate),
        Gauge("glmflash_prefix_cache_pages", "Cache pages held by cached prefixes.",
              lambda: stats().num_cached_pages),
        Gauge("glmflash_prefix_cache_snapshots", "State snapshots held by cached prefixes.",
              lambda: stats().num_snapshots),
        Gauge("glmflash_prefix_cache_max_snapshots", "State snapshots planned at start.",
              lambda: stats().max_snapshots),
    ]


def _speculative_metrics(engine: Engine) -> list[Gauge]:
    """Speculative decoding's acceptance and accepted length per step (none when it is off)."""
    if engine.stats().speculative is None:
        return []

    def stats():
        return engine.stats().speculative

    return [
        CounterView("glmflash_spec_draft_tokens_total", "Draft tokens verified.",
                    lambda: stats().num_draft_tokens),
        CounterView("glmflash_spec_accepted_tokens_total", "Draft tokens accepted.",
                    lambda: stats().num_accepted_tokens),
        Gauge("glmflash_spec_acceptance_rate", "Accepted / verified draft tokens.",
              lambda: stats().acceptance_rate),
        Gauge("glmflash_spec_mean_accepted_length",
              "Tokens a sequence gains per verify step (accepted drafts plus one).",
              lambda: stats().mean_accepted_length),
        Gauge("glmflash_spec_drafting", "1 while the policy lets sequences draft.",
              lambda: float(stats().is_drafting)),
    ]
