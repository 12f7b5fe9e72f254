"""Which intermediate of the KDA prep kernel its 16-bit products put off (GPU only).

    PYTHONPATH=. python bench/kda_diag.py
    DISABLE_MMA_V3=1 PYTHONPATH=. python bench/kda_diag.py   # the same without wgmma

Runs `kda_chunk_prep_kernel` on bf16 inputs (bf16 tensor-core products) and on fp32 copies of
them (fp32 FMA products), and prints the relative difference of every buffer (Aqk, w, u, qg, kd,
exp(G_last)) for a few decay strengths. A difference that changes with the MMA version is the
compiler's, one that does not is precision. Prints only; nothing is appended to RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import rel  # noqa: E402

HEADS, DIM = 4, 128
NAMES = ("w", "u", "qg", "kd", "aqk", "gl")


def _inputs(num_tokens: int, decay: float, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (rnd(num_tokens, HEADS, DIM).bfloat16() for _ in range(3))
    g = -decay * torch.sigmoid(rnd(num_tokens, HEADS, DIM))
    beta = torch.sigmoid(rnd(num_tokens, HEADS)).bfloat16()
    return q, k, v, g, beta


def _prep(ti, q, k, v, g, beta):
    n = q.shape[0]
    plan = ti._plan((0, n), (0,), (False,), q.device)
    buf = ti._prefill_buffers(q, v, plan.num_chunks)
    for t in buf:
        t.fill_(float("nan"))
    strides = (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0))
    ti._launch_prep(q, k, v, g, beta, buf, plan, DIM ** -0.5, strides)
    torch.cuda.synchronize()
    return buf


def main() -> None:
    from glmflash.kernels.kda import triton_impl as ti

    print("| decay | tokens | " + " | ".join(NAMES) + " |")
    print("|---|---|" + "---|" * len(NAMES))
    for decay in (0.05, 5.0):
        n = 200
        inputs = _inputs(n, decay)
        want = _prep(ti, *(t.float() for t in inputs))
        got = _prep(ti, *inputs)
        errs = [f"{rel(a.float(), b.float()):.1e}" for a, b in zip(got, want, strict=True)]
        print(f"| {decay} | {n} | " + " | ".join(errs) + " |", flush=True)


if __name__ == "__main__":
    main()
