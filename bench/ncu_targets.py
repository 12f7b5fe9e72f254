"""One launch of each main GPU kernel at a release shape, for Nsight Compute (GPU only).

    ncu --clock-control none -k regex:'kda_|sparse_mla_kernel|fp8_' \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        python3 bench/ncu_targets.py [OP[:SIZE[:SIZE...]] ...]

bench/ncu_profile.py runs ncu over these targets and prints one summary row per kernel.

OP and its sizes:
    kda:TOKENS          KDA chunked prefill of one sequence
    mla:QUERIES         sparse MLA over 2051 slots of 128K-token caches (one per query up to
                        64 queries, one shared by a prefill's queries)
    fp8:M[:K:N]         `fp8_linear` (what the model calls; 16384->4096 by default)
    smm:M:K:N           per-tensor `torch._scaled_mm` of FP8 operands (the cuBLAS reference)
    bsm:M:K:N           block-scaled `torch._scaled_mm` (1x128 / 128x128 scales) of FP8 operands
    glu:M:K:N           the Gluon block-scaled GEMM (fp8_gemm/gluon_sm90.py) of the same operands
    moe:TOKENS          the fused MoE at release shapes, uniform routing
    idx:CONTEXT:QUERIES indexer select, one decode query per sequence
    idx8:CONTEXT:QUERIES the same over FP8 pooled keys (`--index-key-dtype fp8`)
With none: kda, mla, fp8:1 and fp8:2048. Each op runs twice (the first compiles); only the
shapes are chosen here, the launch parameters are the kernels' own defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import _kda_inputs  # noqa: E402


def kda_prefill(num_tokens: int = 4096):
    from glmflash.kernels.kda import triton_impl as ti

    q, k, v, g, beta, state = _kda_inputs(num_tokens)
    return lambda: ti.kda(q, k, v, g, beta, state, [0, num_tokens], [0], [False])


def sparse_mla(queries: int = 32, context: int = 131072, width: int = 2051):
    from glmflash.kernels.sparse_mla import triton_impl as ti

    # Decodes (up to 64 queries) each read a cache of their own; a prefill's queries share one.
    caches = queries if queries <= 64 else 1
    latent = torch.randn(caches * context, 512, device="cuda").bfloat16()
    q = torch.randn(queries, 64, 512, device="cuda").bfloat16()
    slots = torch.randint(0, context, (queries, width), device="cuda")
    if caches > 1:
        slots += torch.arange(queries, device="cuda")[:, None] * context
    return lambda: ti.sparse_mla(q, latent, slots, scale=1 / 16)


def fp8_linear(m: int, k: int = 16384, n: int = 4096):
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
    x = torch.randn(m, k, device="cuda").bfloat16()
    return lambda: ti.fp8_linear(x, wq, ws)


def scaled_mm(m: int, k: int, n: int):
    from bench.kernels import _scaled_mm

    xq = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    return _scaled_mm(xq, wq)


def block_scaled_mm(m: int, k: int, n: int):
    from bench.gluon_gemm import block_scaled_operands

    xq, xs, wq, ws = block_scaled_operands(m, k, n)
    return lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(),
                                    out_dtype=torch.bfloat16)


def gluon_gemm(m: int, k: int, n: int):
    from bench.gluon_gemm import block_scaled_operands
    from glmflash.kernels.fp8_gemm import gluon_sm90

    xq, xs, wq, ws = block_scaled_operands(m, k, n)
    return lambda: gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16)


def moe(num_tokens: int):
    from bench.fused_moe import LIMIT, expert_weights, routing
    from glmflash.kernels.fused_moe.triton_impl import fused_moe

    w = expert_weights()
    ids, weights = routing(num_tokens, skewed=False)
    x = torch.randn(num_tokens, 4096, device="cuda").bfloat16()
    return lambda: fused_moe(x, ids, weights, *w, limit=LIMIT)


def indexer(context: int, queries: int, fp8: bool = False):
    from bench.kernels import INDEXER_SHAPE, INDEXER_TOPK, indexer_decode_plan, indexer_inputs
    from glmflash.kernels.indexer import key_format
    from glmflash.kernels.indexer import triton_impl as ti

    _, _, kpool, page = INDEXER_SHAPE
    keys, table, q, w = indexer_inputs(queries, queries, context)
    keys = key_format.quantize(keys) if fp8 else keys
    plan = indexer_decode_plan(context, queries)
    return lambda: ti.indexer_select(q, w, keys, table, plan, page_size=page,
                                     topk=INDEXER_TOPK, kpool=kpool, select_tail=True)


OPS = {"kda": kda_prefill, "mla": sparse_mla, "fp8": fp8_linear, "smm": scaled_mm,
       "bsm": block_scaled_mm, "glu": gluon_gemm, "moe": moe, "idx": indexer,
       "idx8": lambda context, queries: indexer(context, queries, fp8=True)}
DEFAULT_TARGETS = ("kda", "mla", "fp8:1", "fp8:2048")


def main(targets: list[str]) -> None:
    for target in targets or DEFAULT_TARGETS:
        name, *sizes = target.split(":")
        call = OPS[name](*(int(s) for s in sizes))
        for _ in range(2):
            call()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
