"""Which intermediate of the KDA prep kernel goes wrong with tensor-core products (GPU only).

    PYTHONPATH=. python bench/kda_diag.py [variant ...]

Runs `kda_chunk_prep_kernel` with each `PREP_PRODUCTS` variant on the same bf16 inputs and prints
the relative difference of every buffer (Aqk, w, u, qg, kd, exp(G_last)) from the fp32-FMA
variant, for a few decay strengths. Prints only; nothing is appended to RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import rel  # noqa: E402

HEADS, DIM = 4, 128


def _inputs(num_tokens: int, decay: float, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k, v = (rnd(num_tokens, HEADS, DIM).bfloat16() for _ in range(3))
    g = -decay * torch.sigmoid(rnd(num_tokens, HEADS, DIM))
    beta = torch.sigmoid(rnd(num_tokens, HEADS)).bfloat16()
    return q, k, v, g, beta


def _prep(ti, variant: str, q, k, v, g, beta):
    ti.PREP_PRODUCTS = variant
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

    names = ("w", "u", "qg", "kd", "aqk", "gl")
    print("| decay | tokens | variant | " + " | ".join(names) + " |")
    variants = sys.argv[1:] or [v for v in ti.PREP_VARIANTS if v != "ieee"]
    for decay in (0.05, 5.0):
        for n in (200,):
            inputs = _inputs(n, decay)
            want = _prep(ti, "ieee", *inputs)
            for variant in variants:
                got = _prep(ti, variant, *inputs)
                errs = [f"{rel(a.float(), b.float()):.1e}" for a, b in zip(got, want, strict=True)]
                print(f"| {decay} | {n} | {variant} | " + " | ".join(errs) + " |", flush=True)
    ti.PREP_PRODUCTS = "ieee"


if __name__ == "__main__":
    main()
