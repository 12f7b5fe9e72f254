"""`glmflash serve` / `python -m glmflash.launch_server`: flag handling and a real start-up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from glmflash.server.args import build_parser, engine_options, inapplicable_flags

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
    assert inapplicable_flags(build_parser().parse_args([]), "cpu", 0, False) == []


def test_engine_rejects_bad_option_values_at_start_up():
    proc = _run(["glmflash.launch_server", "--kt-method", "AMXINT4"], timeout=120)
    assert proc.returncode == 2
    assert "cannot start the engine: kt_method 'AMXINT4' is not supported" in proc.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_starts_and_reports_inapplicable_flags(tiny_dirs, tmp_path):
    port = _free_port()
    log = (tmp_path / "serve.log").open("w+")
    cmd = [sys.executable, "-m", "glmflash.cli", "serve", "--model-path",
           str(tiny_dirs["embedded"]), "--port", str(port), "--served-model-name", "glm-5.3-flash",
           "--context-length", "256", *SEED_FLAGS]
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
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["glm-5.3-flash"]
        assert models["data"][0]["max_model_len"] == 256
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    log.seek(0)
    text = log.read()
    reported = [line.split("glmflash.server.launch: ")[1].split(":")[0]
                for line in text.splitlines() if "WARNING glmflash.server.launch: --" in line]
    assert reported == IGNORED_ON_CPU
    assert "serving glm-5.3-flash on http://127.0.0.1" in text
