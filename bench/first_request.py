"""The first request after start against the same request later (goal: within 1.2x), with and
without the start-up kernel warm-up.

    python bench/first_request.py [--model-path DIR] [--prompt-tokens 2000] [--repeats 5]

Each configuration starts a fresh `glmflash serve` on loopback, times one greedy completion of a
fixed prompt as the first request, then the same request `--repeats` more times, and prints one
line: first, median of the later ones, their ratio.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(model_path: str | None, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "glmflash.cli", "serve", "--port", str(port),
           "--log-level", "warning", "--context-length", "8192",
           "--disable-radix-cache", *extra]  # repeats must not start from a cached prefix
    if model_path:
        cmd += ["--model-path", model_path]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def _time_request(url: str, prompt: list[int], max_tokens: int) -> float:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
    response.raise_for_status()
    return time.perf_counter() - start


def measure(args: argparse.Namespace, label: str, extra: list[str]) -> None:
    proc, url = _serve(args.model_path, extra)
    try:
        prompt = [(7 * i + 3) % 1000 for i in range(args.prompt_tokens)]
        first = _time_request(url, prompt, args.max_tokens)
        later = [_time_request(url, prompt, args.max_tokens) for _ in range(args.repeats)]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    median = statistics.median(later)
    print(f"| {label} | {args.prompt_tokens} + {args.max_tokens} | {first:.3f} s | "
          f"{median:.3f} s | {first / median:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| start-up | prompt + output tokens | first request | later (median) | ratio |")
    print("|---|---|---|---|---|")
    measure(args, "kernel warm-up (default)", [])
    measure(args, "--skip-kernel-warmup", ["--skip-kernel-warmup"])


if __name__ == "__main__":
    main()
