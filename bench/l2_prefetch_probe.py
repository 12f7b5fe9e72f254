"""How much of a small weight-streaming launch an L2 prefetch beside the launch before it saves.

    PYTHONPATH=. python bench/l2_prefetch_probe.py [--programs 64]

A decode step's one-row FP8 linears take 1.5-2x their bytes at the copy bandwidth: with 5-25 MB
of weights, a launch, its ramp and the split-K finish weigh as much as the stream. The launches
before them (mHC pre, the router) are latency-bound and leave most SMs idle. This probe times,
per release shape, in one CUDA graph over rotated weight copies (so weights come from HBM, as
in a step):

- plain: mHC pre at one token, then the one-row FP8 linear;
- prefetched: the same, with a kernel on a second stream, forked before mHC pre and joined
  before the linear, that reads the linear's weights (`.cg` loads: through L2, not L1), so
  that they sit in L2 when the linear runs;
- the linear alone from HBM, and alone on one weight copy (in L2 after the first replay: the
  floor a prefetch could reach);
- mHC pre alone, and the prefetch kernel alone.

The linear's output is the same in every variant (asserted). One table row per shape. GPU only.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import graph_ms, rotated, table  # noqa: E402
from glmflash.kernels.triton_utils import jit  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

# The decode step's one-row FP8 linears (K -> N): the shared expert's stacked gate|up and its
# down projection, and the release shapes of bench/kernels.py.
SHAPES = [(4096, 4096), (2048, 4096), (4096, 1536), (1536, 16384), (16384, 4096),
          (4096, 24576)]
S, D = 4, 4096
TOUCH_BLOCK = 2048


@jit
def l2_touch_kernel(w, sink, n, steps, BLOCK: tl.constexpr):
    """Read `steps` blocks of int32 words of `w` per program through L2 (`.cg`); their sum goes
    to `sink` so the loads are kept."""
    pid = tl.program_id(0)
    o = tl.arange(0, BLOCK)
    b_acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(steps):
        p = (pid * steps + i).to(tl.int64) * BLOCK + o
        b_acc += tl.load(w + p, mask=p < n, other=0, cache_modifier=".cg")
    tl.store(sink + pid * BLOCK + o, b_acc)


def l2_touch(weight: torch.Tensor, sink: torch.Tensor, programs: int) -> None:
    """Read every byte of `weight` (contiguous) through L2 with `programs` programs."""
    words = weight.view(-1).view(torch.int32)
    steps = triton.cdiv(words.numel(), programs * TOUCH_BLOCK)
    l2_touch_kernel[(programs,)](words, sink, words.numel(), steps, BLOCK=TOUCH_BLOCK,
                                 num_warps=8)


def _hyper_inputs() -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = (2 + S) * S
    return dict(streams=torch.randn(1, S, D, generator=gen, device="cuda").bfloat16(),
                fn=(torch.randn(n, S * D, generator=gen, device="cuda") * 0.015).bfloat16(),
                base=torch.randn(n, generator=gen, device="cuda") * 0.5,
                scale=1 + 0.2 * torch.randn(3, generator=gen, device="cuda"))


def shape_row(k: int, n: int, programs: int, pre) -> list:
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm.triton_impl import fp8_linear

    w, ws = quantize_block_fp8(torch.randn(n, k, device="cuda") * 0.02)
    weights = rotated(w)
    x = torch.randn(1, k, device="cuda").bfloat16()
    sink = torch.empty(programs * TOUCH_BLOCK, dtype=torch.int32, device="cuda")
    side = torch.cuda.Stream()
    outs: dict[str, torch.Tensor] = {}

    def plain(w=w):
        pre()
        outs["plain"] = fp8_linear(x, w, ws)

    def prefetched(w=w):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            l2_touch(w, sink, programs)
        pre()
        main.wait_stream(side)
        outs["prefetched"] = fp8_linear(x, w, ws)

    times = {
        "plain": graph_ms([functools.partial(plain, c) for c in weights]),
        "prefetched": graph_ms([functools.partial(prefetched, c) for c in weights]),
        "linear, HBM": graph_ms([functools.partial(fp8_linear, x, c, ws) for c in weights]),
        "linear, L2": graph_ms(lambda: fp8_linear(x, w, ws)),
        "touch alone": graph_ms([functools.partial(l2_touch, c, sink, programs)
                                 for c in weights]),
    }
    assert torch.equal(outs["plain"], outs["prefetched"])
    us = {name: 1e3 * ms for name, ms in times.items()}
    saved = us["plain"] - us["prefetched"]
    return [f"{k}->{n}", f"{w.numel() / 1e6:.1f}", f"{us['plain']:.1f}",
            f"{us['prefetched']:.1f}", f"{saved:+.1f}", f"{us['linear, HBM']:.1f}",
            f"{us['linear, L2']:.1f}", f"{us['touch alone']:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=64,
                        help="programs of the prefetch kernel (mHC pre at one token uses 64)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/l2_prefetch_probe.py needs a CUDA device")
    from glmflash.kernels.hyper.triton_impl import hyper_pre

    h = _hyper_inputs()
    norm = (torch.ones(D, device="cuda").bfloat16(), 1e-5)

    def pre():
        hyper_pre(h["streams"], h["fn"], h["base"], h["scale"], norm_eps=1e-5, hc_eps=1e-6,
                  sinkhorn_iters=20, norm=norm)

    print(f"mHC pre alone (one token, with the input norm): {1e3 * graph_ms(pre):.1f} us",
          flush=True)
    rows = []
    for k, n in SHAPES:
        rows.append(shape_row(k, n, args.programs, pre))
        print(rows[-1], flush=True)
    print(table(["K->N", "MB", "pre + linear us", "with prefetch us", "saved us",
                 "linear alone, HBM", "linear alone, L2", "prefetch kernel alone"], rows))


if __name__ == "__main__":
    main()
