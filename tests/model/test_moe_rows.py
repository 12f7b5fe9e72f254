"""A MoE layer's GPU experts (the Triton fused MoE) hand their rows to the decoder layer's
hyper_post unsummed (`MoE.parts(x, unsummed=True)`): the same streams as summing them in a
launch of their own, and no such launch. On the CPU the layer's own experts run the CPU
kernel, so there the test drives the fused MoE over the layer's weights under the interpreter;
with CUDA also the layer itself."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.fused_moe import ExpertRows, expert_rows
from glmflash.kernels.hyper import hyper_post, hyper_pre
from glmflash.model.moe import MoE, grouped_experts
from tests.conftest import load_tiny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_routed_rows_summed_in_the_post(tiny_dirs, dtype, monkeypatch):
    for op in ("FUSED_MOE", "HYPER"):
        monkeypatch.setenv(f"GLMFLASH_KERNEL_{op}", "triton")
    model = load_tiny(tiny_dirs["embedded"], dtype).to(DEVICE)
    layer = next(m for m in model.modules() if isinstance(getattr(m, "mlp", None), MoE))
    moe = layer.mlp
    streams = torch.randn(5, model.config.hc_mult, model.config.hidden_size,
                          generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    with torch.no_grad():
        post, comb, x = hyper_pre(streams, layer.hc_ffn_fn, layer.hc_ffn_base,
                                  layer.hc_ffn_scale, **layer.hc_kwargs)
        ids, weights = moe.gate(x)
        shared = moe.shared_experts(x)
        experts = (x, ids, weights, moe.experts.projections(), moe.experts.limit)
        want = hyper_post(grouped_experts(*experts), streams, post, comb, extra=shared)
        monkeypatch.setattr(expert_rows, "fused_moe_sum_kernel", None)  # a launch would fail
        rows = grouped_experts(*experts, rows=True)
        assert isinstance(rows, ExpertRows)
        assert torch.equal(hyper_post(rows, streams, post, comb, extra=shared), want)
        if DEVICE == "cuda":
            routed, shared = moe.parts(x, unsummed=True)
            assert isinstance(routed, ExpertRows)
            assert torch.equal(hyper_post(routed, streams, post, comb, extra=shared), want)
