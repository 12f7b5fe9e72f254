"""The command line as a user types it, on the embedded tiny checkpoint."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest


def _run(args: list[str], cache, timeout: int = 180) -> subprocess.CompletedProcess:
    exe = shutil.which("glmflash")
    cmd = [exe] if exe else [sys.executable, "-m", "glmflash.cli"]
    env = dict(os.environ, GLMFLASH_CACHE_DIR=str(cache))
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=timeout)


def test_generate_on_the_embedded_checkpoint(tmp_path):
    proc = _run(["generate", "--prompt", "Hello, GLM", "--prompt", "Second", "--max-tokens", "5"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 2 and any(line.strip() for line in lines)
    assert "making the embedded tiny checkpoint" in proc.stderr
    assert (tmp_path / "tiny-v1-seed0" / "config.json").exists()
    again = _run(["generate", "--prompt", "Hello, GLM", "--prompt", "Second", "--max-tokens", "5"],
                 tmp_path)
    assert again.stdout == proc.stdout  # greedy by default, and the cache is reused
    assert "making the embedded tiny checkpoint" not in again.stderr


def test_make_tiny_is_deterministic(tmp_path):
    for name in ("a", "b"):
        proc = _run(["make-tiny", str(tmp_path / name), "--seed", "3"], tmp_path / "cache")
        assert proc.returncode == 0, proc.stderr
    for file in sorted((tmp_path / "a").iterdir()):
        assert file.read_bytes() == (tmp_path / "b" / file.name).read_bytes(), file.name


@pytest.mark.parametrize("args,message", [
    (["generate"], "--prompt"),
    (["generate", "--prompt", "x", "--dtype", "int3"], "unknown dtype"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_arguments_fail_clearly(tmp_path, args, message):
    proc = _run(args, tmp_path)
    assert proc.returncode != 0 and message in proc.stderr
