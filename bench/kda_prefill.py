"""KDA chunked prefill on the GPU: accuracy against the fp32 reference, time against fla's
chunk_kda (default and safe-gate paths). bench/kda_sweep.py compares launch configurations.

Called by bench/kernels.py (`--ops kda`); the tables it returns go to bench/RESULTS.md there.
"""

from __future__ import annotations

import torch

from bench.common import bench_ms, kernel_ms, rel, table
from bench.kernels import D, _fla, _kda_inputs
from glmflash.kernels.kda import triton_impl as ti

WALK_KERNEL = "kda_chunk_state_kernel"


def _setup(n: int):
    q, k, v, g, beta, state = _kda_inputs(n)
    return (q, k, v, g, beta), state


def _fla_runner(chunk_kda, inputs, n: int, safe_gate: bool):
    q, k, v, g, beta = inputs
    cu_t = torch.tensor([0, n], device="cuda")
    gate = {"safe_gate": True, "lower_bound": -5.0} if safe_gate else {}

    def run(s0):
        return chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=D ** -0.5,
                         initial_state=s0, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, cu_seqlens=cu_t, **gate)

    return run


def bench_kda_prefill(sizes: list[int]) -> str:
    chunk_kda, _ = _fla()
    rows = []
    for n in sizes:
        rows.append(_prefill_row(n, chunk_kda))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return table(["tokens (1 seq)", "triton ms", "stages before the walk ms", "state walk ms",
                  "fla chunk_kda ms (default / safe gate)", "fla safe gate / triton (goal >= 1)",
                  "rel diff vs fla safe gate (o / state)"], rows)


def _prefill_row(n: int, chunk_kda) -> list:
    inputs, state = _setup(n)
    s_mine = state.clone()
    out = ti.kda(*inputs, s_mine, [0, n], [0], [False])
    clone_ms = bench_ms(lambda: state.clone())
    ms = bench_ms(lambda: ti.kda(*inputs, state.clone(), [0, n], [0], [False])) - clone_ms
    s_scratch = state.clone()
    kernels = kernel_ms(lambda: ti.kda(*inputs, s_scratch, [0, n], [0], [False]))
    walk_ms = kernels.pop(WALK_KERNEL, 0.0)
    row = [n, f"{ms:.3f}", f"{sum(kernels.values()):.3f}", f"{walk_ms:.3f}"]
    if chunk_kda is None:
        return row + ["n/a", "n/a", "n/a"]
    default, safe = (_fla_runner(chunk_kda, inputs, n, s) for s in (False, True))
    o_fla, s_fla = safe(state.clone())
    default_ms = bench_ms(lambda: default(state.clone())) - clone_ms
    safe_ms = bench_ms(lambda: safe(state.clone())) - clone_ms
    return row + [f"{default_ms:.3f} / {safe_ms:.3f}", f"{safe_ms / ms:.2f}",
                  f"{rel(out, o_fla[0]):.1e} / {rel(s_mine, s_fla):.1e}"]


def check_kda_accuracy(sizes: list[int]) -> str:
    """Relative errors of the prefill's output and state against the fp32 reference on the
    GPU, and fla's (safe gate) for comparison."""
    chunk_kda, _ = _fla()
    rows = []
    for n in sizes:
        rows.append([n, *_accuracy(n, chunk_kda)])
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return table(["tokens", "rel err o", "rel err state", "fla rel err o / state"], rows)


def _accuracy(n: int, chunk_kda) -> list[str]:
    from glmflash.kernels.kda import kda_ref

    inputs, state = _setup(n)
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(*inputs, s_ref, [0, n], [0], [False])
    got = ti.kda(*inputs, s_got, [0, n], [0], [False])
    fla = "n/a"
    if chunk_kda is not None:
        o_fla, s_fla = _fla_runner(chunk_kda, inputs, n, True)(state.clone())
        fla = f"{rel(o_fla[0].float(), want.float()):.1e} / {rel(s_fla, s_ref):.1e}"
    return [f"{rel(got.float(), want.float()):.1e}", f"{rel(s_got, s_ref):.1e}", fla]
