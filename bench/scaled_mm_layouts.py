"""Which scale layouts cuBLASLt's block-scaled `torch._scaled_mm` accepts, and which are right:
relative error of each (activation scales, weight scales) layout against the fp32 reference, on
square and non-square scale grids. A wrong layout can be accepted silently."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from glmflash.kernels.fp8_gemm import fp8_linear_ref, quantize_block_fp8  # noqa: E402
from glmflash.kernels.fp8_gemm.triton_impl import (  # noqa: E402
    fp8_linear_w8a8,
    quantize_activations,
)


def main() -> None:
    print("| N x K | M | sa layout | sb layout | rel err vs ref |")
    print("|---|---|---|---|---|")
    for n, k, m in ((384, 256, 64), (512, 256, 64), (384, 512, 64), (384, 1536, 64),
                    (256, 384, 64), (1536, 4096, 64), (4096, 4096, 64), (384, 256, 2048)):
        gen = torch.Generator().manual_seed(0)
        w, s = quantize_block_fp8(torch.randn(n, k, generator=gen))
        x = torch.randn(m, k, generator=gen).bfloat16().cuda()
        w, s = w.cuda(), s.cuda()
        want = fp8_linear_ref(x.float(), w, s)

        def rel(y: torch.Tensor, want: torch.Tensor = want) -> float:
            return ((y.float() - want).norm() / want.norm()).item()
        print(f"| {n}x{k} | {m} | triton w8a8 | - | {rel(fp8_linear_w8a8(x, w, s, 128)):.2e} |")
        for sa_name, m_major in (("M-major", True), ("row-major", False)):
            xq, xs = quantize_activations(x, w.dtype, 128, scales_m_major=m_major)
            for sb_name, sb in (("s.t()", s.t()), ("s.t().contiguous()", s.t().contiguous()),
                                ("s", s)):
                try:
                    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=sb,
                                         out_dtype=torch.bfloat16)
                    err = f"{rel(y):.2e}"
                except Exception as e:  # noqa: BLE001 - report what cuBLAS refuses
                    err = f"refused: {str(e).splitlines()[0][:60]}"
                print(f"| {n}x{k} | {m} | {sa_name} {tuple(xs.stride())} | {sb_name} "
                      f"{tuple(sb.shape)} {tuple(sb.stride())} | {err} |", flush=True)


if __name__ == "__main__":
    main()
