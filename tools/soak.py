"""Soak test: a bounded mixed load against a real `glmflash serve` on loopback, then SIGTERM.

    python tools/soak.py [--minutes 10] [--clients 32] [--hostile 0.1] [--model-path DIR]
                         [--json FILE] [--markdown FILE]

Clients (tools/soak_traffic.py) send valid chats and completions (streamed or not), hostile
requests from the schema fuzzer (tools/request_fuzz.py), oversized bodies, streams they drop,
requests they abort and bursts past --max-queued-requests; /health is polled throughout and the
server's RSS sampled. After the load the server must be idle with its whole cache free; a last
few streams are running when it gets SIGTERM, and must end with [DONE]; it must exit 0 with no
traceback and a clean cache. The report: requests by outcome, lost valid requests, hostile
requests not answered 4xx, p50/p99 latency (valid requests, /health), RSS after warm-up, peak and
end. Exit status 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tools.soak_report import Report, check_goals, markdown  # noqa: E402
from tools.soak_traffic import Tally, Traffic  # noqa: E402

MODEL = "soak"
MAX_REQUEST_BYTES = 4 << 20
GRACE_S = 5
SERVER_FLAGS = ["--served-model-name", MODEL, "--max-queued-requests", "48",
                "--context-length", "2048", "--max-request-bytes", str(MAX_REQUEST_BYTES),
                "--graceful-shutdown-timeout", str(GRACE_S)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model_path: str | None, port: int, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "glmflash.cli", "serve", "--port", str(port), *SERVER_FLAGS]
    if model_path:
        cmd += ["--model-path", model_path]
    # NOTE: INFO for the lifecycle lines the report reads (shutdown, cache integrity).
    env = dict(os.environ, GLMFLASH_LOG_LEVEL="INFO")
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def sample_rss(pid: int, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append(rss_mb(pid))
        await asyncio.sleep(0.5)


async def probe_health(url: str, latencies: list[float], failures: list[str],
                       stop: asyncio.Event) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while not stop.is_set():
            start = time.perf_counter()
            try:
                response = await client.get(f"{url}/health")
                if response.status_code != 200:
                    failures.append(f"{response.status_code} {response.text[:100]}")
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
            latencies.append(time.perf_counter() - start)
            await asyncio.sleep(0.1)


async def run_load(url: str, args: argparse.Namespace, tally: Tally, seconds: float,
                   seed: int) -> None:
    limits = httpx.Limits(max_connections=args.clients * 32, max_keepalive_connections=64)
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        clients = [Traffic(url, MODEL, tally, seed * 1000 + i, args.hostile, MAX_REQUEST_BYTES)
                   for i in range(args.clients)]
        await asyncio.gather(*(c.run(client, deadline) for c in clients))


async def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    """The engine gauges once nothing is queued or running (the last values if it never is)."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            text = (await client.get(f"{url}/metrics")).text
            gauges = {name: float(value) for name, value in re.findall(
                r"^glmflash_(num_queued_requests|num_running_requests|cache_usage_fraction) "
                r"(\S+)$", text, re.M)}
            if not any(gauges.values()) or time.monotonic() > deadline:
                return gauges
            await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, url: str, pid: int, report: Report) -> None:
    stop, rss = asyncio.Event(), []
    health: list[float] = []
    sampler = asyncio.create_task(sample_rss(pid, rss, stop))
    prober = asyncio.create_task(probe_health(url, health, report.health_failures, stop))
    await run_load(url, args, report.tally, args.warmup_s, seed=1)
    report.rss_after_warmup = rss_mb(pid)
    health.clear()
    started = time.monotonic()
    await run_load(url, args, report.tally, args.minutes * 60, seed=2)
    report.load_s = time.monotonic() - started
    report.idle_gauges = await wait_idle(url)
    await asyncio.sleep(2)
    report.rss_end = rss_mb(pid)
    stop.set()
    await asyncio.gather(sampler, prober)
    report.rss_peak = max(rss)
    report.health_latencies = health


async def _stream_until_end(url: str) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "last words"}],
            "max_tokens": 1500, "ignore_eos": True, "stream": True}
    try:
        async with httpx.AsyncClient(timeout=120) as client, \
                client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            events = [line async for line in response.aiter_lines() if line]
    except httpx.HTTPError as exc:
        return f"transport error {exc!r}"
    if not events or events[-1] != "data: [DONE]":
        return "no [DONE]"
    return "error event" if '"error"' in events[-2] else "finished"


async def sigterm_phase(url: str, proc: subprocess.Popen, report: Report) -> None:
    streams = [asyncio.create_task(_stream_until_end(url)) for _ in range(4)]
    await asyncio.sleep(1.5)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    report.sigterm_streams = await asyncio.gather(*streams)
    report.exit_code = await asyncio.to_thread(proc.wait, GRACE_S + 60)
    report.shutdown_s = time.monotonic() - sent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--hostile", type=float, default=0.1, help="share of hostile requests")
    parser.add_argument("--warmup-s", type=float, default=20)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--log", type=Path, default=Path("soak-server.log"))
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    parser.add_argument("--markdown", type=Path, default=None, help="append the table here")
    args = parser.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(args.model_path, port, args.log)
    report = Report(clients=args.clients, hostile=args.hostile, minutes=args.minutes)
    try:
        wait_healthy(url, proc)
        asyncio.run(soak(args, url, proc.pid, report))
        asyncio.run(sigterm_phase(url, proc, report))
    finally:
        if proc.poll() is None:
            proc.kill()
    report.read_log(args.log.read_text(errors="replace"))
    missed = check_goals(report)
    table = markdown(report, missed)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(report.as_dict(missed), indent=2))
    if args.markdown:
        with args.markdown.open("a") as f:
            f.write(table)
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
