"""Where the KDA prep kernel spends its time (GPU only; prints a table, appends nothing).

    PYTHONPATH=. python bench/kda_parts.py [--tokens 4096 32768]

No hardware counters are needed: the prep kernel's two later stages are run alone, each as its
own kernel over the same (chunk, head) grid and through the same jitted helpers, and the first
stage (the Aqk / Akk products, with l2 norms and decay anchoring) is what is left of the whole:
- inverse: the prep's `_unit_tril_inverse` of a stored strictly lower-triangular 64 x 64 matrix;
- WY phase: `_wy_phase` (w, u, qg, kd, exp(G_last)) from a stored T;
- whole prep at the default warps and at the other warp count, and the state walk for scale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms  # noqa: E402
from bench.kernels import D, H, _kda_inputs  # noqa: E402
from glmflash.kernels.kda import triton_impl as ti  # noqa: E402
from glmflash.kernels.triton_utils import dot_operand_type, product_precision  # noqa: E402

BT = 64
OTHER_WARPS = 8 if ti.DEFAULT_CONFIG.prep_warps == 4 else 4


@triton.jit
def inverse_only_kernel(a, t, DOT: tl.constexpr):
    """The prep's (I + A)^-1 of stored matrices."""
    i = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, 64)
    p = i * 4096 + o[:, None] * 64 + o[None, :]
    b_t = ti._unit_tril_inverse(tl.load(p + a), 64)
    tl.store(t + p, b_t.to(DOT))


@triton.jit
def wy_only_kernel(q, k, v, g, beta, w, u, qg, kd, gl, tmat, meta, scale, stride_q, stride_k,
                   stride_v, stride_g, stride_b, H: tl.constexpr, K: tl.constexpr,
                   V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BKC: tl.constexpr,
                   PREC: tl.constexpr, DOT: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    p_t = (i_c * H + i_h).to(tl.int64) * 4096 + o_t[:, None] * 64 + o_t[None, :]
    b_t = tl.load(tmat + p_t).to(DOT)
    o_r = t0 + o_t
    b_b = tl.load(beta + o_r.to(tl.int64) * stride_b + i_h, mask=o_r < t_end,
                  other=0.0).to(tl.float32)
    b_rn = tl.full([64], 1.0, dtype=tl.float32)
    ti._wy_phase(q, k, v, g, w, u, qg, kd, gl, b_t, b_b, b_rn * scale, b_rn, t0, t_end, i_c, i_h,
                 stride_q, stride_k, stride_v, stride_g, H, K, V, BK, BVF, BKC, PREC, DOT)


def _parts_row(n: int) -> list:
    q, k, v, g, beta, state = _kda_inputs(n)
    plan = ti._plan((0, n), (0,), (False,), q.device)
    buf = ti._prefill_buffers(q, v, plan.num_chunks)
    strides = (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0))
    scale = D ** -0.5

    def prep(config=ti.DEFAULT_CONFIG):
        ti._launch_prep(q, k, v, g, beta, buf, plan, scale, strides, config)

    config = ti.DEFAULT_CONFIG
    whole = graph_ms(prep)
    whole_other = graph_ms(lambda: prep(ti.KdaConfig(prep_warps=OTHER_WARPS)))
    programs = plan.num_chunks * H
    a = torch.randn(programs, BT, BT, device="cuda").tril(-1) * 0.1
    t = torch.empty(programs, BT, BT, device="cuda", dtype=q.dtype)
    dot = dot_operand_type(q.dtype)
    inverse = graph_ms(lambda: inverse_only_kernel[(programs,)](
        a, t, DOT=dot, num_warps=config.prep_warps))
    chunk_meta = plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]
    wy = graph_ms(lambda: wy_only_kernel[(plan.num_chunks, H)](
        q, k, v, g, beta, buf.w, buf.u, buf.qg, buf.kd, buf.gl, t, chunk_meta, scale, *strides,
        H=H, K=D, V=D, BK=D, BVF=D, BKC=config.prep_key_block,
        PREC=product_precision(q.dtype), DOT=dot, num_warps=config.prep_warps))
    walk = graph_ms(lambda: ti._launch_state(state, torch.empty_like(v), buf, plan))
    return [n, f"{whole:.3f}", f"{whole_other:.3f}", f"{inverse:.3f}", f"{wy:.3f}",
            f"{whole - inverse - wy:.3f}", f"{walk:.3f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    args = parser.parse_args()
    print(f"prep at {ti.DEFAULT_CONFIG.prep_warps} warps; times in ms, graph-timed")
    print(f"| tokens | prep | prep at {OTHER_WARPS} warps | inverse alone | "
          "WY phase alone | A products (rest) | state walk |")
    print("|---|---|---|---|---|---|---|")
    for n in args.tokens:
        print("| " + " | ".join(str(c) for c in _parts_row(n)) + " |", flush=True)


if __name__ == "__main__":
    main()
