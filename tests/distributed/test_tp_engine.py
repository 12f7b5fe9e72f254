"""Two CPU ranks over gloo, started by the engine itself: the same greedy tokens as one rank
(through the CLI with expert parallelism, through the Engine with tensor-parallel experts), and
every way a rank can fail or be interrupted ends every rank with the error, within a timeout.

Each engine spawns one process (seconds), so one engine serves several checks where it can.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glmflash.distributed.group import RankFailed
from glmflash.engine.engine import Engine
from glmflash.sampling_params import SamplingParams

PROMPTS = ["Hello there", "The cat sat on"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Bounds on a loaded 2-core CI machine: spawn, load and warm-up of both ranks included.
RUN_TIMEOUT_S = 180
EXIT_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from glmflash.tiny.embedded import embedded_checkpoint

    return embedded_checkpoint()


@pytest.fixture(scope="module")
def one_rank(model_dir) -> list[str]:
    engine = Engine(model_dir, device="cpu", background_loop=False, skip_kernel_warmup=True)
    return [r.text for r in engine.generate(PROMPTS, GREEDY)]


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, GLMFLASH_DIST_TIMEOUT_S="60", **extra)


def _generate_cmd(model_dir: Path, *flags: str) -> list[str]:
    cmd = [sys.executable, "-m", "glmflash.cli", "generate", "--model-path", str(model_dir),
           "--device", "cpu", "--max-tokens", str(GREEDY.max_tokens), *flags]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    return cmd


def _session_processes(sid: int) -> list[int]:
    """Processes still alive in session `sid` (the CLI's spawned ranks would be there)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _assert_no_ranks_left(sid: int) -> None:
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while _session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _session_processes(sid), "a rank outlived the command"


def test_cli_two_ranks_expert_parallel_same_tokens(model_dir, one_rank):
    started = time.monotonic()
    proc = subprocess.Popen(_generate_cmd(model_dir, "--tp-size", "2", "--ep-size", "2"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)
    stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, stderr
    assert stdout.splitlines() == one_rank
    _assert_no_ranks_left(proc.pid)
    print(f"two-rank CLI run: {time.monotonic() - started:.1f} s")


def test_tensor_parallel_experts_then_rank0_fails_mid_step(model_dir, one_rank, monkeypatch):
    engine = Engine(model_dir, device="cpu", tp_size=2, ep_size=1, skip_kernel_warmup=True)
    assert [r.text for r in engine.generate(PROMPTS, GREEDY)] == one_rank
    # Rank 0 raises right after sending a step: rank 1 waits in that step's all-reduce.
    monkeypatch.setenv("GLMFLASH_TEST_FAULT", f"0:step{engine.runner.num_steps + 2}")
    with pytest.raises(RuntimeError, match="rank 0 failed in a step: RuntimeError: injected"):
        engine.generate(PROMPTS, GREEDY)
    assert "rank 0 failed" in engine.failure
    engine.shutdown()
    assert not multiprocessing.active_children()


def test_rank1_fails_mid_step(model_dir, monkeypatch):
    monkeypatch.setenv("GLMFLASH_TEST_FAULT", "1:step3")
    engine = Engine(model_dir, device="cpu", tp_size=2, skip_kernel_warmup=True)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 failed in a step: RuntimeError: injected"):
        engine.generate(PROMPTS, GREEDY)
    assert time.monotonic() - started < EXIT_TIMEOUT_S
    with pytest.raises(RuntimeError, match="engine has stopped"):
        engine.generate(PROMPTS, GREEDY)
    engine.shutdown()
    assert not multiprocessing.active_children()


def test_rank1_fails_at_load(model_dir, monkeypatch):
    monkeypatch.setenv("GLMFLASH_TEST_FAULT", "1:load")
    with pytest.raises(RankFailed, match="rank 1 failed at load: RuntimeError: injected"):
        Engine(model_dir, device="cpu", tp_size=2, skip_kernel_warmup=True)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


def test_rank1_dying_before_it_starts_is_reported_at_once(model_dir, monkeypatch):
    """A spawned rank that exits before reaching the store (here an exception at its start;
    in life a script without a __main__ guard) is named at once, not after the process
    group's join timeout (60 s here, 600 by default)."""
    monkeypatch.setenv("GLMFLASH_TEST_FAULT", "1:start")
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 exited with code 1 before it started"):
        Engine(model_dir, device="cpu", tp_size=2, skip_kernel_warmup=True)
    assert time.monotonic() - started < EXIT_TIMEOUT_S
    assert not multiprocessing.active_children()


def _psm_segments() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("psm_")}


def test_a_start_failing_after_the_ranks_leaves_nothing(model_dir):
    """Refused options checked after the ranks are up (an unknown media kind): the ranks stop,
    the shared segment goes, and another split engine can start in this process."""
    before = _psm_segments()
    with pytest.raises(ValueError, match="unknown media kinds"):
        Engine(model_dir, device="cpu", tp_size=2, skip_kernel_warmup=True,
               limit_mm_data_per_request={"audio": 1})
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
    assert _psm_segments() <= before
    engine = Engine(model_dir, device="cpu", tp_size=2, skip_kernel_warmup=True)
    try:
        assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        engine.shutdown()


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_every_rank(model_dir):
    # Past EOS up to the context: generation is still running when the signal comes.
    cmd = _generate_cmd(model_dir, "--tp-size", "2", "--ignore-eos")
    cmd[cmd.index("--max-tokens") + 1] = "100000"
    # A terminal's Ctrl-C: SIGINT handled as by default, also when this test runs where it is
    # ignored (a shell's background job ignores SIGINT, and its children inherit that).
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(GLMFLASH_LOG_LEVEL="INFO"), start_new_session=True,
                            preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        for line in proc.stderr:
            if "engine ready" in line or time.monotonic() > deadline:
                break
        time.sleep(1.0)  # into generation
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the whole group
        proc.communicate(timeout=EXIT_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130
    _assert_no_ranks_left(proc.pid)


def test_a_split_the_heads_do_not_allow_is_refused_before_any_rank_starts(model_dir,
                                                                          monkeypatch):
    """tp_size 3 over 4 heads: one clear error from rank 0 before any rank is started (each
    rank would have logged its own refusal)."""
    import glmflash.engine.parallel_runner as parallel_runner

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")
    monkeypatch.setattr(parallel_runner, "start_ranks", no_ranks)
    with pytest.raises(ValueError, match="is not divisible by tp_size 3"):
        Engine(model_dir, device="cpu", tp_size=3, skip_kernel_warmup=True)
