"""Every user error of the commands is one line on stderr, exit status 2, no traceback, found
before the model loads; --debug shows the traceback; --version and --help say what they should."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

SERVE = ["glmflash.cli", "serve"]
LAUNCH = ["glmflash.launch_server"]
GENERATE = ["glmflash.cli", "generate", "--prompt", "x"]


def _run(args: list[str], timeout: int = 120, **variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GLMFLASH_LOG_LEVEL": "INFO", **variables}
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _one_line_error(proc: subprocess.CompletedProcess, message: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr and "loading" not in proc.stderr.lower()
    return lines[0]


@pytest.fixture(scope="module")
def broken_checkpoints(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("broken")
    no_tokenizer = root / "no-tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(tiny_dirs["embedded"] / "config.json", no_tokenizer)
    garbage = root / "garbage-tokenizer"
    shutil.copytree(tiny_dirs["embedded"], garbage)
    (garbage / "tokenizer.json").write_text("{ this is not a tokenizer")
    return {"no_tokenizer": no_tokenizer, "garbage": garbage,
            "file": tiny_dirs["embedded"] / "config.json", "missing": root / "nowhere"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", [SERVE, LAUNCH, GENERATE])
def test_cuda_without_cuda(command):
    _one_line_error(_run([*command, "--device", "cuda"]), "--device cuda: no CUDA device")


@pytest.mark.parametrize("command", [SERVE, GENERATE])
def test_unknown_device(command):
    _one_line_error(_run([*command, "--device", "tpu"]), "--device tpu: unknown device")


@pytest.mark.parametrize("case,message", [
    ("file", "is a file; pass the checkpoint folder"),
    ("missing", "no such folder"),
    ("no_tokenizer", "tokenizer.json is missing"),
    ("garbage", "tokenizer.json is not a valid tokenizer file"),
])
def test_bad_checkpoint_folders(broken_checkpoints, case, message):
    path = str(broken_checkpoints[case])
    line = _one_line_error(_run([*GENERATE, "--model-path", path]), message)
    if case in ("no_tokenizer", "garbage"):
        assert path in line


@pytest.mark.parametrize("flags,message", [
    (["--max-tokens", "-1"], "argument --max-tokens: must be >= 1, got -1"),
    (["--top-p", "2"], "argument --top-p: must be in (0, 1], got 2.0"),
    (["--temperature", "nan"], "argument --temperature: expected a finite number"),
])
def test_bad_sampling_flags(flags, message):
    _one_line_error(_run([*GENERATE, *flags]), message)


@pytest.mark.parametrize("command", [SERVE, GENERATE])
def test_fp8_index_queries_without_fp8_keys(command):
    """An engine option refused by EngineConfig is one line, before the model loads (serve
    binds its port first: a free one)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = ["--port", str(sock.getsockname()[1])] if command is SERVE else []
    _one_line_error(_run([*command, *port, "--index-query-dtype", "fp8"]),
                    "index_query_dtype 'fp8' needs index_key_dtype 'fp8'")


@pytest.mark.parametrize("command", [SERVE, LAUNCH, GENERATE])
def test_bad_log_level_variable(command):
    """Checked first (a missing checkpoint folder would be the error otherwise)."""
    _one_line_error(_run([*command, "--device", "cpu", "--model-path", "/nowhere"],
                         GLMFLASH_LOG_LEVEL="verbose"),
                    "GLMFLASH_LOG_LEVEL='verbose': expected one of debug, info, warning")


@pytest.mark.parametrize("command,value", [(GENERATE, "abc"), (GENERATE, "-1"), (SERVE, "nan")])
def test_bad_dist_timeout_variable(command, value):
    """Checked before the model loads (and before --tp-size starts any rank)."""
    _one_line_error(_run([*command, "--device", "cpu", "--tp-size", "2"],
                         GLMFLASH_DIST_TIMEOUT_S=value),
                    f"GLMFLASH_DIST_TIMEOUT_S='{value}': expected seconds > 0")


def test_environment_values(monkeypatch):
    from glmflash.utils import env

    for value, level in (("", "INFO"), ("debug", "DEBUG"), (" Warning ", "WARNING")):
        monkeypatch.setenv("GLMFLASH_LOG_LEVEL", value)
        assert env.log_level() == level
    monkeypatch.setenv("GLMFLASH_LOG_LEVEL", "10")
    with pytest.raises(ValueError, match="GLMFLASH_LOG_LEVEL='10'"):
        env.log_level()
    for value, seconds in (("", 600.0), ("0.5", 0.5), ("60", 60.0)):
        monkeypatch.setenv("GLMFLASH_DIST_TIMEOUT_S", value)
        assert env.dist_timeout_s() == seconds
    for value in ("abc", "0", "-1", "nan", "inf", "1e99"):
        monkeypatch.setenv("GLMFLASH_DIST_TIMEOUT_S", value)
        with pytest.raises(ValueError, match=f"GLMFLASH_DIST_TIMEOUT_S='{value}': expected"):
            env.dist_timeout_s()


def test_a_busy_port_fails_before_the_model_loads():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        proc = _run([*SERVE, "--port", str(port), "--kt-cpuinfer", "999"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 2, proc.stderr
    # --kt-cpuinfer past the cores is clamped with a warning, before anything loads.
    assert "--kt-cpuinfer 999: this machine gives the process" in lines[0]
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in lines[1]


def test_debug_shows_the_traceback():
    proc = _run([*SERVE, "--device", "tpu", "--debug"])
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "UsageError" in proc.stderr


@pytest.mark.parametrize("command", [["glmflash.cli"], LAUNCH])
def test_version(command):
    proc = _run([*command, "--version"])
    assert proc.returncode == 0 and proc.stdout.startswith("glmflash ")


def test_serve_help_shows_defaults():
    proc = _run([*SERVE, "--help"])
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for shown in ("--port PORT (default: 30000)", "--host HOST (default: 127.0.0.1)",
                  "(engine default: 16)", "--graceful-shutdown-timeout SECONDS",
                  "(default: 33554432)"):
        assert shown in text, shown
