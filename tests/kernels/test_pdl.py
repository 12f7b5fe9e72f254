"""Programmatic dependent launch: which launches take it, and that kernels launched with it give
the bits of plain launches (on SM90 GPUs; the engine-level check is in
tests/engine/test_cuda_graph_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels import triton_utils
from glmflash.kernels.triton_utils import pdl_options


def test_no_pdl_on_the_cpu_or_under_the_interpreter(monkeypatch):
    assert pdl_options(torch.device("cpu")) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl_options(torch.device("cuda", 0)) == {}


def test_pdl_follows_the_capability_and_the_switch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(triton_utils, "_has_pdl", lambda index: index == 0)
    assert pdl_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert pdl_options(torch.device("cuda", 1)) == {}  # before SM90
    monkeypatch.setenv("GLMFLASH_PDL", "0")
    assert pdl_options(torch.device("cuda", 0)) == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available()
                    or torch.cuda.get_device_capability() < (9, 0), reason="needs SM90")
def test_a_graph_of_pdl_launches_gives_the_plain_bits(monkeypatch):
    """hyper_pre -> FP8 linear -> router -> fused MoE -> hyper_post, each launch reading the one
    before it, replayed from a CUDA graph with PDL and without: equal bits."""
    from glmflash.kernels.fp8_gemm import quantize_block_fp8
    from glmflash.kernels.fp8_gemm.triton_impl import fp8_linear
    from glmflash.kernels.fused_moe.triton_impl import fused_moe
    from glmflash.kernels.hyper.triton_impl import hyper_post, hyper_pre
    from glmflash.kernels.router import RouterSpec
    from glmflash.kernels.router.triton_impl import route

    gen = torch.Generator(device="cuda").manual_seed(0)
    dev, s, d, experts, inter = "cuda", 4, 1024, 16, 256

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, device=dev) * scale

    streams = rnd(2, s, d).bfloat16()
    fn = rnd((2 + s) * s, s * d, scale=0.02).bfloat16()
    base, scale = rnd((2 + s) * s, scale=0.5), 1 + 0.2 * rnd(3)
    w, ws = quantize_block_fp8(rnd(d, d, scale=0.05))
    router_w, bias = rnd(experts, d, scale=0.05).bfloat16(), rnd(experts, scale=0.1)
    stack = [quantize_block_fp8(rnd(experts, n, k, scale=0.05))
             for n, k in ((inter, d), (inter, d), (d, inter))]
    spec = RouterSpec(2, 1, 1, True, 2.5)

    def chain():
        post, comb, x = hyper_pre(streams, fn, base, scale, norm_eps=1e-5, hc_eps=1e-6,
                                  sinkhorn_iters=20)
        x = fp8_linear(x, w, ws)
        ids, weights = route(x, router_w, bias, spec=spec)
        y = fused_moe(x, ids, weights, *stack[0], *stack[1], *stack[2], limit=10.0)
        return hyper_post(y, streams, post, comb)

    outs = {}
    for switch in ("0", "1"):
        monkeypatch.setenv("GLMFLASH_PDL", switch)
        chain()  # compile and allocate outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain()
        graph.replay()
        torch.cuda.synchronize()
        outs[switch] = out.clone()
    assert torch.equal(outs["0"], outs["1"])
