"""The command line as a user types it, on the embedded tiny checkpoint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

from tools.tiny_tasks import known_words

_KNOWN_WORDS = known_words()


def _run(args: list[str], cache, timeout: int = 180) -> subprocess.CompletedProcess:
    exe = shutil.which("glmflash")
    cmd = [exe] if exe else [sys.executable, "-m", "glmflash.cli"]
    env = dict(os.environ, GLMFLASH_CACHE_DIR=str(cache))
    return subprocess.run(cmd + args, capture_output=True, text=True, env=env, timeout=timeout)


def test_generate_on_the_embedded_checkpoint(tmp_path):
    """The README's first command: the trained checkpoint in the package answers readably."""
    proc = _run(["generate", "--prompt", "Hello, GLM", "--prompt", "Second", "--max-tokens", "24"],
                tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) >= 2 and any(line.strip() for line in lines)
    words = re.findall(r"[A-Za-z']+", lines[0])
    assert len(words) >= 5 and sum(w.lower() in _KNOWN_WORDS for w in words) >= 0.9 * len(words), \
        lines[0]
    assert not any(tmp_path.iterdir())  # nothing is made: the checkpoint ships in the package
    again = _run(["generate", "--prompt", "Hello, GLM", "--prompt", "Second", "--max-tokens", "24"],
                 tmp_path)
    assert again.stdout == proc.stdout  # greedy by default


def test_generate_reports_flags_without_effect(tmp_path):
    """As `serve` does: one warning line per flag that does nothing on the device."""
    proc = _run(["generate", "--prompt", "x", "--max-tokens", "1", "--device", "cpu",
                 "--mem-fraction-static", "0.5", "--kt-num-gpu-experts", "4"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    ignored = [line.split("WARNING glmflash.cli: ")[-1] for line in proc.stderr.splitlines()
               if ": ignored: " in line]
    assert ignored == ["--kt-num-gpu-experts 4: ignored: every expert runs on the cpu",
                       "--mem-fraction-static 0.5: ignored: on cpu the cache size comes from "
                       "--cache-budget-gb"], proc.stderr


def test_make_tiny_makes_the_random_checkpoint_once(tmp_path):
    proc = _run(["make-tiny"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(tmp_path / "tiny-v1-seed0")
    assert "making the random tiny checkpoint" in proc.stderr
    assert "making" not in _run(["make-tiny"], tmp_path).stderr


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
