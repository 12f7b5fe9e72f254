"""`glmflash serve` / `python -m glmflash.launch_server`: flag handling and a real start-up."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from glmflash.server.args import build_parser, engine_options, inapplicable_flags
from glmflash.tiny.embedded import embedded_checkpoint

SEED_FLAGS = ["--kt-method", "FP8", "--kt-cpuinfer", "1", "--kt-threadpool-count", "2",
              "--kt-num-gpu-experts", "40", "--kt-gpu-prefill-token-threshold", "2048",
              "--kt-weight-path", "/nowhere", "--cuda-graph-bs", "1", "2", "4", "--tp-size", "4",
              "--mem-fraction-static", "0.6", "--limit-mm-data-per-request", '{"image": 4}',
              "--mm-process-config", '{"image": {"max_pixels": 1003520}}']


IGNORED_ON_CPU = ["--cuda-graph-bs 1 2 4", "--tp-size 4", "--kt-weight-path /nowhere",
                  "--kt-num-gpu-experts 40", "--kt-gpu-prefill-token-threshold 2048",
                  "--kt-threadpool-count 2", "--mem-fraction-static 0.6"]


def _run(args: list[str], timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args,message", [
    (["glmflash.cli", "serve", "--bogus-flag", "1"], "unrecognized arguments: --bogus-flag"),
    (["glmflash.launch_server", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["glmflash.launch_server", "--model", "x"], "unrecognized arguments: --model"),
    (["glmflash.launch_server", "--port", "http"], "argument --port: expected an integer"),
    # getaddrinfo wraps a port past 65535: 70000 would listen on 4464.
    (["glmflash.launch_server", "--port", "70000"], "--port: must be in 1..65535, got 70000"),
    (["glmflash.cli", "serve", "--port", "0"], "--port: must be in 1..65535, got 0"),
    # `--api-key "$KEY"` with KEY unset would turn authentication off; spaces lock clients out.
    (["glmflash.launch_server", "--api-key", ""], "argument --api-key: must not be empty"),
    (["glmflash.cli", "serve", "--api-key", "  "], "--api-key: must not be only whitespace"),
    (["glmflash.launch_server", "--api-key", "k "], "--api-key: must not start or end with"),
    (["glmflash.launch_server", "--mem-fraction-static", "1.5"], "must be in (0, 1]"),
    (["glmflash.launch_server", "--mm-process-config", "{x"], "not valid JSON"),
    (["glmflash.launch_server", "--tool-call-parser", "qwen25"], "invalid choice: 'qwen25'"),
])
def test_bad_flags_fail_clearly(args, message):
    proc = _run(args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_flags_map_to_engine_options():
    args = build_parser().parse_args(["--context-length", "4096", "--chunked-prefill-size", "-1",
                                      "--max-running-requests", "8", "--api-key", "k"])
    assert engine_options(args) == {"context_length": 4096, "chunked_prefill_size": 2**31 - 1,
                                    "max_running_requests": 8}
    seed = engine_options(build_parser().parse_args(SEED_FLAGS))
    assert seed["kt_cpuinfer"] == 1 and seed["kt_method"] == "FP8"
    assert seed["limit_mm_data_per_request"] == {"image": 4}
    assert seed["cuda_graph_bs"] == [1, 2, 4]
    assert args.port == 30000 and args.tool_call_parser == "glm47"
    assert args.reasoning_parser == "glm45"


def test_bind_socket_refuses_a_port_past_65535():
    from glmflash.server.launch import bind_socket
    from glmflash.utils.preflight import UsageError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    with pytest.raises(UsageError, match=f"--port {free + 65536}: must be in 1..65535"):
        bind_socket("127.0.0.1", free + 65536).close()


def test_inapplicable_flags_of_generate():
    """`glmflash generate` has no --kt-weight-path and passes --tp-size to the engine as given."""
    from glmflash.cli import build_parser as build_cli_parser

    args = build_cli_parser().parse_args(["generate", "--prompt", "x", "--tp-size", "4",
                                          "--mem-fraction-static", "0.5",
                                          "--kt-num-gpu-experts", "4"])
    assert [line.split(":")[0] for line in inapplicable_flags(
        args, "cuda", 1, True, for_server=False)] == []
    assert [line.split(":")[0] for line in inapplicable_flags(
        args, "cpu", 0, True, for_server=False)] == ["--kt-num-gpu-experts 4",
                                                     "--mem-fraction-static 0.5"]


def test_inapplicable_flags_one_line_each():
    args = build_parser().parse_args(SEED_FLAGS)
    lines = inapplicable_flags(args, "cpu", 0, supports_media=True)
    assert [line.split(":")[0] for line in lines] == IGNORED_ON_CPU
    assert lines[0] == "--cuda-graph-bs 1 2 4: ignored: CUDA graphs need a CUDA device"
    assert "--tp-size 4: ignored: only 0 CUDA device(s) visible" in lines[1]
    without_media = inapplicable_flags(args, "cpu", 0, supports_media=False)
    assert len(without_media) == len(lines) + 2
    gpu = build_parser().parse_args(["--cuda-graph-bs", "8", "--tp-size", "2", "--kt-cpuinfer",
                                     "8", "--cache-budget-gb", "4"])
    assert [line.split(":")[0] for line in inapplicable_flags(gpu, "cuda", 8, True)] == [
        "--kt-cpuinfer 8", "--cache-budget-gb 4.0"]
    cpu_ranks = build_parser().parse_args(["--device", "cpu", "--tp-size", "2", "--ep-size", "2"])
    assert engine_options(cpu_ranks) == {"tp_size": 2, "ep_size": 2}
    assert inapplicable_flags(cpu_ranks, "cpu", 0, True) == []
    hybrid = build_parser().parse_args(["--kt-num-gpu-experts", "4", "--kt-cpuinfer", "8",
                                        "--kt-gpu-prefill-token-threshold", "512"])
    assert inapplicable_flags(hybrid, "cuda", 1, True) == []
    hybrid_ep = build_parser().parse_args(["--tp-size", "2", "--ep-size", "2",
                                           "--kt-num-gpu-experts", "4"])
    assert inapplicable_flags(hybrid_ep, "cuda", 2, True) == [
        "--ep-size 2: ignored: with --kt-num-gpu-experts every routed expert lives on rank 0"]
    assert inapplicable_flags(build_parser().parse_args([]), "cpu", 0, False) == []


def test_engine_rejects_bad_option_values_at_start_up():
    proc = _run(["glmflash.launch_server", "--kt-method", "AMXINT4"], timeout=120)
    assert proc.returncode == 2
    assert "cannot start the engine: kt_method 'AMXINT4' is not supported" in proc.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def _serving(model_path, flags: list[str], log_path):
    """`glmflash serve` of `model_path` on a free port with `flags`: yields (its URL, its log
    file); stopped by SIGINT, which must end it cleanly."""
    port = _free_port()
    log = log_path.open("w+")
    cmd = [sys.executable, "-m", "glmflash.cli", "serve", "--model-path", str(model_path),
           "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", log
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_serve_starts_and_reports_inapplicable_flags(tiny_dirs, tmp_path):
    flags = ["--served-model-name", "glm-5.3-flash", "--context-length", "256", *SEED_FLAGS]
    with _serving(tiny_dirs["embedded"], flags, tmp_path / "serve.log") as (url, log):
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["glm-5.3-flash"]
        assert models["data"][0]["max_model_len"] == 256
    log.seek(0)
    text = log.read()
    reported = [line.split("glmflash.server.launch: ")[1].split(":")[0]
                for line in text.splitlines() if "WARNING glmflash.server.launch: --" in line]
    assert reported == IGNORED_ON_CPU
    assert "serving glm-5.3-flash on http://127.0.0.1" in text


def test_serve_with_nextn_gives_the_tokens_of_mtp_off(tmp_path):
    """`glmflash serve --speculative-algorithm NEXTN --speculative-num-steps 1` on the trained
    tiny model (its MTP layer included): greedy answers equal to serving without drafts, token
    for token, with drafts verified on every step (the speed check off) and the acceptance in
    /metrics."""
    request = {"model": "default", "temperature": 0, "max_tokens": 48, "ignore_eos": True,
               "logprobs": True, "messages": [
                   {"role": "user", "content": "What time is it? Use the clock tool."}]}
    base = ["--device", "cpu", "--dtype", "float32", "--served-model-name", "default"]
    nextn = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1",
             "--disable-speculative-speed-check"]
    answers, metrics = {}, ""
    for name, flags in (("off", base), ("nextn", base + nextn)):
        with _serving(embedded_checkpoint(), flags, tmp_path / f"{name}.log") as (url, _):
            answers[name] = httpx.post(f"{url}/v1/chat/completions", json=request,
                                       timeout=120).json()["choices"][0]
            if name == "nextn":
                metrics = httpx.get(f"{url}/metrics").text
    tokens = {name: [t["token"] for t in choice["logprobs"]["content"]]
              for name, choice in answers.items()}
    assert len(tokens["off"]) == 48 and tokens["nextn"] == tokens["off"]
    accepted = re.search(r"^glmflash_spec_accepted_tokens_total (\S+)$", metrics, re.M)
    assert accepted and float(accepted.group(1)) > 0, metrics
