"""KDA chunked prefill candidates side by side on the GPU: per-stage and total times at each
length against fla's chunk_kda (safe-gate path), and each candidate's error against the fp32
reference (lengths up to `REF_MAX_TOKENS`) or against fla (longer ones). Prints only.

    PYTHONPATH=. python bench/sweeps.py --ops kda_prefill [--kda-tokens 32768,131072]
        [--kda-candidates all|NAME,...]   (default: SWEEP_DEFAULT)
    PYTHONPATH=. python -m bench.kda_sweep --warm   (compiles what the GPU tests and the
        default sweep launch, in parallel, into Triton's disk cache)

The candidates' kernels are compiled first in one subprocess each, in parallel (Triton's disk
cache hands them to this process). The intra kernels are the slow compiles
(tools/smem_check.py times them), so each candidate with its own intra shape adds some. Stage
times are CUDA-graph replay medians of each kernel alone on buffers the previous stages filled;
totals are event-timed whole `kda` calls, as fla's (whose launcher reads the host).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import torch

from bench.common import event_ms, graph_ms, kernel_ms, rel
from bench.kernels import _fla, _kda_inputs
from glmflash.kernels.kda import chunk_stages as cs
from glmflash.kernels.kda import chunk_walk
from glmflash.kernels.kda import triton_impl as ti

REF_MAX_TOKENS = 32768
_STAGED = cs.StagedConfig()
CANDIDATES = {
    "staged": ti.KdaConfig(staged=_STAGED),
    "staged diag w2": ti.KdaConfig(staged=dataclasses.replace(_STAGED, diag_warps=2)),
    "staged diag k16": ti.KdaConfig(staged=dataclasses.replace(_STAGED, diag_key_block=16)),
    "staged off w4": ti.KdaConfig(staged=dataclasses.replace(_STAGED, off_warps=4)),
    "staged diag regs free": ti.KdaConfig(staged=dataclasses.replace(_STAGED,
                                                                    diag_max_registers=None)),
    "staged solve tf32": ti.KdaConfig(staged=dataclasses.replace(
        _STAGED, solve_precision="tf32")),
    "staged T fp32": ti.KdaConfig(staged=dataclasses.replace(_STAGED, inverse_bf16=False)),
    "staged wy k64 w4": ti.KdaConfig(staged=dataclasses.replace(_STAGED, wy_block=64,
                                                                wy_warps=4)),
    "staged walk v32": ti.KdaConfig(staged=_STAGED, state_value_block=32),
    "staged walk v128 w4": ti.KdaConfig(staged=_STAGED, state_value_block=128, state_warps=4),
}

SWEEP_DEFAULT = ("staged", "staged diag regs free")
# (candidate, dtype) of every prefill the KDA GPU tests run (tests/kernels/test_kda_prefill.py,
# test_kda_chunk_stages.py).
TEST_FORMS = tuple((name, "bfloat16") for name in (
    "staged", "staged solve tf32", "staged T fp32", "staged diag regs free")) + (
    ("staged", "float32"),)


def _stages(inputs, state, plan, config: ti.KdaConfig) -> dict:
    """Each stage of `config`'s prefill as a call on buffers of its own, in order."""
    q, k, v, g, beta = inputs
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    s = config.staged
    sb = cs.staged_buffers(q, v, plan.num_chunks, s)
    fns = {"gate+intra": lambda: cs.launch_intra(q, k, g, beta, sb, plan, s)}
    fns["w/u"] = lambda: cs.launch_wy(q, k, v, beta, sb, plan, s)
    fns["walk+out"] = lambda: chunk_walk.launch_state(state, out, sb.walk, plan, config)
    return fns


def _stage_times(inputs, state, plan, config: ti.KdaConfig) -> dict[str, float]:
    fns = _stages(inputs, state.clone(), plan, config)
    for fn in fns.values():
        fn()
    return {name: graph_ms(fn, rep=10) for name, fn in fns.items()}


def _errors(inputs, state, n: int, config: ti.KdaConfig, want) -> str:
    """rel err of (o, state) against `want` (the fp32 reference's, or fla's)."""
    s_got = state.clone()
    got = ti.kda(*inputs, s_got, [0, n], [0], [False], config=config)
    return f"{rel(got.float(), want[0].float()):.1e} / {rel(s_got, want[1]):.1e}"


def _reference(inputs, state, n: int, chunk_kda):
    """(label, (o, state)) to measure errors against: the fp32 reference up to REF_MAX_TOKENS,
    else fla's safe-gate output (None without fla)."""
    if n <= REF_MAX_TOKENS:
        from glmflash.kernels.kda import kda_ref

        s_ref = state.clone()
        return "fp32 ref", (kda_ref(*inputs, s_ref, [0, n], [0], [False]), s_ref)
    if chunk_kda is None:
        return "none", None
    from bench.kda_prefill import _fla_runner

    o_fla, s_fla = _fla_runner(chunk_kda, inputs, n, True)(state.clone())
    return "fla safe gate", (o_fla[0], s_fla)


def warm(name: str, dtype: str = "bfloat16") -> None:
    """Compiles candidate `name`'s kernels for `dtype` inputs at the release head shape: a
    prefill of partial chunks and a one-token sequence (the decode kernel)."""
    q, k, v, g, beta, state = _kda_inputs(301, 2)
    if dtype != "bfloat16":
        q, k, v, beta = (t.to(getattr(torch, dtype)) for t in (q, k, v, beta))
    ti.kda(q, k, v, g, beta, state, [0, 300, 301], [0, 1], [False, True],
           config=CANDIDATES[name])
    torch.cuda.synchronize()


def _compile_in_parallel(forms: list[tuple[str, str]]) -> list[subprocess.Popen]:
    """One subprocess per (candidate, dtype) running `warm`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return [subprocess.Popen([sys.executable, "-c",
                              f"from bench.kda_sweep import warm; warm({n!r}, {d!r})"], env=env)
            for n, d in forms]


def warm_all(forms=TEST_FORMS) -> None:
    """Compiles `forms` (and the default sweep) in parallel; Triton's disk cache keeps them for
    the processes that follow (the GPU tests, the sweep)."""
    forms = list(dict.fromkeys(list(forms) + [(n, "bfloat16") for n in SWEEP_DEFAULT]))
    start = time.time()
    procs = _compile_in_parallel(forms)
    failed = [f for f, p in zip(forms, procs, strict=True) if p.wait() != 0]
    print(f"kda warm: {len(forms)} forms compiled in {time.time() - start:.0f} s; "
          f"failed: {failed or 'none'}", flush=True)
    if failed:
        sys.exit(1)


def sweep_kda(sizes: list[int], names: list[str] | None = None) -> None:
    """Per length: fla's time and error, then every candidate's stage times, total, speed
    relative to fla (goal >= 1) and error. `names`: SWEEP_DEFAULT when None, ["all"] for
    every candidate."""
    names = list(CANDIDATES) if names == ["all"] else list(names or SWEEP_DEFAULT)
    start = time.time()
    procs = _compile_in_parallel([(n, "bfloat16") for n in names])
    chunk_kda, _ = _fla()
    if chunk_kda is not None:  # fla autotunes on its first call, meanwhile
        from bench.kda_prefill import _fla_runner

        inputs = _kda_inputs(4096)
        _fla_runner(chunk_kda, inputs[:5], 4096, True)(inputs[5].clone())
        del inputs
    failed = [n for n, p in zip(names, procs, strict=True) if p.wait() != 0]
    print(f"kda compiled in {time.time() - start:.0f} s; failed: {failed or 'none'}", flush=True)
    names = [n for n in names if n not in failed]
    for n in sizes:
        _sweep_size(n, chunk_kda, names)


def profile_kda(n: int, names: list[str]) -> None:
    """GPU ms of each kernel of fla's safe-gate prefill and of each candidate's, at n tokens
    (each run advances a scratch state of its own, so no copy shows among the kernels)."""
    q, k, v, g, beta, state = _kda_inputs(n)
    inputs = (q, k, v, g, beta)
    chunk_kda, _ = _fla()
    runs = {}
    if chunk_kda is not None:
        from bench.kda_prefill import _fla_runner

        run = _fla_runner(chunk_kda, inputs, n, True)
        s_fla = state.clone()
        runs["fla safe gate"] = lambda: run(s_fla)
    for name in names:
        config, scratch = CANDIDATES[name], state.clone()
        runs[name] = lambda c=config, s=scratch: ti.kda(*inputs, s, [0, n], [0], [False],
                                                         config=c)
    for label, fn in runs.items():
        times = kernel_ms(fn)
        parts = ", ".join(f"{kernel[:48]} {ms:.3f}" for kernel, ms in times.items()
                          if ms >= 0.01)
        print(f"kda profile n={n} {label}: {sum(times.values()):.3f} ms | {parts}", flush=True)


def _sweep_size(n: int, chunk_kda, names: list[str]) -> None:
    from bench.kda_prefill import _fla_runner

    q, k, v, g, beta, state = _kda_inputs(n)
    inputs = (q, k, v, g, beta)
    plan = ti._plan((0, n), (0,), (False,), q.device)
    label, want = _reference(inputs, state, n, chunk_kda)
    fla_ms = None
    if chunk_kda is not None:
        run = _fla_runner(chunk_kda, inputs, n, True)
        s0 = state.clone()
        fla_ms = event_ms(lambda: run(s0))
        fla_err = "-" if label != "fp32 ref" else (
            f"{rel(run(state.clone())[0][0].float(), want[0].float()):.1e}")
        print(f"kda n={n} fla chunk_kda safe gate: {fla_ms:.3f} ms, err o vs {label} {fla_err}",
              flush=True)
    for name in names:
        config = CANDIDATES[name]
        stages = _stage_times(inputs, state, plan, config)
        s0 = state.clone()
        total = event_ms(lambda c=config, s=s0: ti.kda(*inputs, s, [0, n], [0], [False],
                                                       config=c))
        speed = f"{fla_ms / total:.2f}" if fla_ms else "n/a"
        err = _errors(inputs, state, n, config, want) if want is not None else "n/a"
        parts = " ".join(f"{s} {ms:.3f}" for s, ms in stages.items())
        print(f"kda n={n} {name}: total {total:.3f} ms (fla/ours {speed}) | {parts} | "
              f"err o / state vs {label} {err}", flush=True)
        torch.cuda.empty_cache()
    del q, k, v, g, beta, state, want
    torch.cuda.empty_cache()


if __name__ == "__main__":
    assert sys.argv[1:] == ["--warm"], "usage: python -m bench.kda_sweep --warm"
    warm_all()
