"""Does Triton's automatic warp specialisation run the block-FP8 GEMM on this GPU?

    PYTHONPATH=. python bench/ws_probe.py

Each form runs in its own process with a time limit, since a miscompiled warp-specialised
kernel hangs the GPU rather than failing: a TMA-fed FP8 GEMM of 8192 x 4096 x 4096 with
`tl.range(warp_specialize=...)` on its K loop, plain (`acc = dot(a, b, acc)`), with one
weight scale per block, and with the per-row x per-column block scales of the W8A8 recipe
(fp8_gemm/README.md). Prints TFLOP/s and the error against an fp32 product, or "hung".
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

PLAIN, ONE_SCALE, BLOCK_SCALES = 0, 1, 2
SHAPE = (8192, 4096, 4096)
# (warp_specialize, scales, masked scale loads, stages, warps): the unspecialised forms first.
FORMS = [(0, PLAIN, 0, 4, 8), (0, BLOCK_SCALES, 1, 4, 8), (1, PLAIN, 0, 3, 4),
         (1, ONE_SCALE, 0, 3, 4), (1, BLOCK_SCALES, 0, 3, 4), (1, BLOCK_SCALES, 1, 3, 4),
         (1, BLOCK_SCALES, 0, 4, 4)]


@triton.jit
def probe_kernel(x_desc, w_desc, xs, ws, y, M, N, K, stride_sm, stride_wsn, stride_ym,
                 BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, WS: tl.constexpr,
                 SCALES: tl.constexpr, MASK: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    p_xs = xs + o_m * stride_sm
    p_ws = ws + (o_n // BLOCK) * stride_wsn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, warp_specialize=WS):
        a = x_desc.load([i_m * BM, k0])
        b = w_desc.load([i_n * BN, k0])
        if SCALES == 0:
            acc = tl.dot(a, b.T, acc)
        elif SCALES == 1:
            acc += tl.dot(a, b.T) * tl.load(ws + (i_n * BN // BLOCK) * stride_wsn + k0 // BLOCK)
        else:
            if MASK:
                sa = tl.load(p_xs + k0 // BLOCK, mask=o_m < M, other=0.0)
                sb = tl.load(p_ws + k0 // BLOCK, mask=o_n < N, other=0.0)
            else:
                sa = tl.load(p_xs + k0 // BLOCK)
                sb = tl.load(p_ws + k0 // BLOCK)
            acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
    tl.store(y + o_m[:, None] * stride_ym + o_n[None, :], acc.to(y.dtype.element_ty))


def run_form(ws_on: int, scales: int, mask: int, stages: int, warps: int) -> str:
    m, n, k = SHAPE
    xq = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    xs = torch.rand(m, k // 128, device="cuda") + 0.5
    ws = torch.rand(n // 128, k // 128, device="cuda") + 0.5
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    descs = [TensorDescriptor.from_tensor(t, [128, 128]) for t in (xq, wq)]

    def launch():
        probe_kernel[(m // 128, n // 128)](*descs, xs, ws, y, m, n, k, xs.stride(0),
                                           ws.stride(0), y.stride(0), BLOCK=128, BM=128, BN=128,
                                           WS=ws_on, SCALES=scales, MASK=mask,
                                           num_warps=warps, num_stages=stages)

    launch()
    torch.cuda.synchronize()
    err = float("nan")
    if scales == BLOCK_SCALES:
        want = (xq.float() * xs.repeat_interleave(128, 1)) @ (
            wq.float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)).T
        err = ((y.float() - want).norm() / want.norm()).item()
    ms = triton.testing.do_bench_cudagraph(launch, rep=50)
    return f"{ms * 1e3:.0f} us, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s, err {err:.1e}"


def main() -> None:
    print(f"Triton {triton.__version__}, {torch.cuda.get_device_name()}, "
          f"{'x'.join(map(str, SHAPE))}", flush=True)
    for form in FORMS:
        name = "ws={} scales={} masked={} stages={} warps={}".format(*form)
        began = time.time()
        try:
            done = subprocess.run([sys.executable, __file__, *map(str, form)], timeout=40,
                                  capture_output=True, text=True)
            lines = (done.stdout + done.stderr).strip().splitlines()
            print(f"{name}: {lines[-1] if lines else f'exit {done.returncode}'}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"{name}: hung ({time.time() - began:.0f} s)", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        print(run_form(*map(int, sys.argv[1:])))
    else:
        main()
