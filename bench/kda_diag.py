"""Which KDA prefill intermediate the 16-bit products put off, and whether the compiler is to
blame (GPU only).

    PYTHONPATH=. python bench/kda_diag.py
    DISABLE_MMA_V3=1 PYTHONPATH=. python bench/kda_diag.py   # the same without wgmma

Runs the stages before the state walk (gate, intra, w/u) on bf16 inputs (TF32 and bf16
products) and on fp32 copies of them (fp32 products) and prints the relative difference of
every buffer they hand the walk (w, u, qg, kd, Aqk, exp(G_last)), then the whole prefill's
output and state against the fp32 reference, for a weak, the release-strength and a steep
decay (the last takes the exact diagonal form). The intra stage's products are all mma.sync or
FMA (M = 16); the w/u and walk's 64-row products may become wgmma. A difference that changes
with DISABLE_MMA_V3 is the compiler's, one that does not is precision. Prints only; nothing is
appended to RESULTS.md.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import rel  # noqa: E402

HEADS, DIM, TOKENS = 4, 128, 200
NAMES = ("w", "u", "qg", "kd", "aqk", "gl")


def _inputs(decay: float, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (rnd(TOKENS, HEADS, DIM).bfloat16() for _ in range(3))
    g = -decay * torch.sigmoid(rnd(TOKENS, HEADS, DIM))
    beta = torch.sigmoid(rnd(TOKENS, HEADS)).bfloat16()
    state = rnd(1, HEADS, DIM, DIM) * 0.1
    return (q, k, v, g, beta), state


def _stages(inputs):
    """The walk's buffers after the gate with intra, and w/u stages."""
    from glmflash.kernels.kda import chunk_stages as cs
    from glmflash.kernels.kda import triton_impl as ti

    q, k, v, g, beta = inputs
    config = ti.DEFAULT_CONFIG.staged
    plan = ti._plan((0, TOKENS), (0,), (False,), q.device)
    buf = cs.staged_buffers(q, v, plan.num_chunks, config)
    for t in buf.walk:
        t.fill_(float("nan"))
    cs.launch_intra(q, k, g, beta, buf, plan, config)
    cs.launch_wy(q, k, v, beta, buf, plan, config)
    torch.cuda.synchronize()
    return buf.walk


def _prefill_errors(inputs, state) -> list[str]:
    from glmflash.kernels.kda import kda_ref
    from glmflash.kernels.kda import triton_impl as ti

    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(*inputs, s_ref, [0, TOKENS], [0], [False])
    got = ti.kda(*inputs, s_got, [0, TOKENS], [0], [False])
    return [f"{rel(got.float(), want.float()):.1e}", f"{rel(s_got, s_ref):.1e}"]


def main() -> None:
    print(f"DISABLE_MMA_V3={os.environ.get('DISABLE_MMA_V3', '')!r}; walk buffers bf16 vs fp32 "
          f"inputs, then the bf16 prefill vs the fp32 reference ({TOKENS} tokens, {HEADS} x {DIM})")
    print("| decay | " + " | ".join(NAMES) + " | o | state |")
    print("|---|" + "---|" * (len(NAMES) + 2))
    for decay in (0.05, 5.0, 20.0):
        inputs, state = _inputs(decay)
        want = _stages([t.float() for t in inputs])
        got = _stages(inputs)
        errs = [f"{rel(a.float(), b.float()):.1e}" for a, b in zip(got, want, strict=True)]
        errs += _prefill_errors(inputs, state)
        print(f"| {decay} | " + " | ".join(errs) + " |", flush=True)


if __name__ == "__main__":
    main()
