"""One launch of each main GPU kernel at a release shape, for Nsight Compute (GPU only).

    ncu --clock-control none -k regex:'kda_|sparse_mla_kernel|fp8_' \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \\
        python3 bench/ncu_targets.py [OP[:SIZE] ...]

OP is kda (SIZE tokens), mla (SIZE queries) or fp8 (SIZE rows); with none, kda, mla, fp8:1 and
fp8:2048. Each op runs once to compile and once more; only the shapes are chosen here, the
launch parameters are the kernels' own defaults.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.kernels import _kda_inputs  # noqa: E402


def kda_prefill(num_tokens: int = 4096) -> None:
    from glmflash.kernels.kda import triton_impl as ti

    q, k, v, g, beta, state = _kda_inputs(num_tokens)
    ti.kda(q, k, v, g, beta, state, [0, num_tokens], [0], [False])


def sparse_mla(queries: int = 32, context: int = 131072, width: int = 2051) -> None:
    from glmflash.kernels.sparse_mla import triton_impl as ti

    latent = torch.randn(queries * context, 512, device="cuda").bfloat16()
    q = torch.randn(queries, 64, 512, device="cuda").bfloat16()
    slots = torch.randint(0, context, (queries, width), device="cuda") \
        + torch.arange(queries, device="cuda")[:, None] * context
    ti.sparse_mla(q, latent, slots, scale=1 / 16)


def fp8_linear(m: int, k: int = 16384, n: int = 4096) -> None:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm import triton_impl as ti

    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda"))
    ti.fp8_linear(torch.randn(m, k, device="cuda").bfloat16(), wq, ws)


OPS = {"kda": kda_prefill, "mla": sparse_mla, "fp8": fp8_linear}
DEFAULT_TARGETS = ("kda", "mla", "fp8:1", "fp8:2048")


def main(targets: list[str]) -> None:
    for target in targets or DEFAULT_TARGETS:
        name, _, size = target.partition(":")
        args = (int(size),) if size else ()
        for _ in range(2):
            OPS[name](*args)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
