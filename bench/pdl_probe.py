"""How much of a decode step's kernel boundaries Programmatic Dependent Launch (SM90) could save.

    PYTHONPATH=. python bench/pdl_probe.py [--kernels 256] [--elements 16384] [--programs 16 132]

A decode step replays about 40 small kernels a layer from a CUDA graph, each waiting for the
one before it to finish before its blocks start. With PDL a kernel is launched while the one
before it still runs; its programs wait (`griddepcontrol.wait`) only where they first read what
that kernel wrote. This probe times, in one CUDA graph, a chain of small dependent Triton kernels
(each reads the previous one's output: y = 1.0001 x + 1 over `--elements` bf16 values, the size
of one token's activations) without PDL, with PDL and the wait at the start, and with PDL and
the wait after a load that does not depend on the previous kernel (as a kernel that reads its
weights first would); then the same chain with a torch kernel every fourth link (cuBLAS and
torch's own kernels do not take part in PDL). Every variant's result must equal the plain
chain's (the waits keep the order); it prints one table row per variant. SM90 and Triton with
`launch_pdl` only; elsewhere it says so and exits.
"""

from __future__ import annotations

import argparse

import torch

from bench.common import graph_ms

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


if triton is not None:
    @triton.jit
    def link_kernel(x, y, w, n, BLOCK: tl.constexpr, WAIT: tl.constexpr,
                    WEIGHTS_FIRST: tl.constexpr):
        """y = x * w + 1 over one block; with WAIT the program waits for the kernel before
        it (PDL) before reading x, after reading its weight when WEIGHTS_FIRST."""
        o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = o < n
        if WEIGHTS_FIRST:
            b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
        if WAIT:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        if not WEIGHTS_FIRST:
            b_w = tl.load(w + o, mask=m, other=0.0).to(tl.float32)
        b_x = tl.load(x + o, mask=m, other=0.0).to(tl.float32)
        tl.store(y + o, (b_x * b_w + 1.0).to(y.dtype.element_ty), mask=m)


def _chain(bufs, weight, kernels: int, programs: int, pdl: bool, weights_first: bool,
           torch_every: int) -> torch.Tensor:
    n = bufs[0].numel()
    block = triton.next_power_of_2(triton.cdiv(n, programs))
    for i in range(kernels):
        src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        if torch_every and i % torch_every == torch_every - 1:
            torch.mul(src, 1.0001, out=dst)
            continue
        extra = {"launch_pdl": True} if pdl else {}
        link_kernel[(triton.cdiv(n, block),)](src, dst, weight, n, BLOCK=block, WAIT=pdl,
                                              WEIGHTS_FIRST=weights_first, num_warps=4, **extra)
    return bufs[kernels % 2]


def run(kernels: int, elements: int, programs: list[int]) -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("PDL needs an SM90 or newer GPU")
        return
    print(f"Triton {triton.__version__}, {torch.cuda.get_device_name()}; {kernels} dependent "
          f"kernels over {elements} bf16 values, replayed from one CUDA graph")
    print("| programs | variant | replay us | us per kernel | same result |")
    print("|---|---|---|---|---|")
    weight = torch.full((elements,), 1.0001, dtype=torch.bfloat16, device="cuda")
    variants = [("plain", False, False, 0), ("PDL, wait first", True, False, 0),
                ("PDL, weight then wait", True, True, 0),
                ("plain, torch every 4th", False, False, 4),
                ("PDL, torch every 4th", True, False, 4)]
    start = torch.randn(elements, generator=torch.Generator().manual_seed(0)).bfloat16().cuda()
    for count in programs:
        want = {}
        for name, pdl, weights_first, torch_every in variants:
            bufs = [start.clone(), torch.empty_like(start)]

            def step(bufs=bufs, pdl=pdl, weights_first=weights_first, torch_every=torch_every,
                     count=count):
                bufs[0].copy_(start)
                return _chain(bufs, weight, kernels, count, pdl, weights_first, torch_every)

            try:
                us = 1e3 * graph_ms(step)
            except (TypeError, KeyError, RuntimeError) as error:  # no launch_pdl here
                print(f"| {count} | {name} | failed: {str(error).splitlines()[0][:80]} | | |")
                continue
            result = step().clone()
            torch.cuda.synchronize()
            key = torch_every
            same = "-" if key not in want else str(torch.equal(result, want[key]))
            want.setdefault(key, result)
            print(f"| {count} | {name} | {us:.1f} | {us / kernels:.2f} | {same} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=int, default=256)
    parser.add_argument("--elements", type=int, default=16384)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 132])
    args = parser.parse_args()
    run(args.kernels, args.elements, args.programs)


if __name__ == "__main__":
    main()
