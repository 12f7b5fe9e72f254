"""The tiny model with the numba CPU experts == with the reference experts (all-CPU mode)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glmflash.kernels.fp8_gemm import quantize_block_fp8
from glmflash.model.moe import Experts, experts_loop
from tests.conftest import PackedRunner, load_tiny

# Both compute in fp32; only the summation order over experts and K blocks differs
# (measured max 1.0e-5 on the logits of these models).
NUMBA_VS_REF_ATOL = 5e-5


@pytest.mark.parametrize("variant", ["embedded", "recipe"])
def test_numba_experts_match_reference_experts(tiny_dirs, variant, monkeypatch):
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (29, 6, 1)]
    numba_model = load_tiny(tiny_dirs[variant])
    numba_logits = PackedRunner(numba_model, 3).forward(dict(enumerate(prompts)))
    kinds = {type(m.cpu_kernel).__name__ for m in numba_model.modules() if isinstance(m, Experts)}
    assert kinds == {"NumbaMoeExperts"}
    monkeypatch.setenv("GLMFLASH_KERNEL_CPU_MOE", "ref")
    ref_model = load_tiny(tiny_dirs[variant])
    ref_logits = PackedRunner(ref_model, 3).forward(dict(enumerate(prompts)))
    kinds = {type(m.cpu_kernel).__name__ for m in ref_model.modules() if isinstance(m, Experts)}
    assert kinds == {"RefMoeExperts"}
    assert (numba_logits - ref_logits).abs().max().item() < NUMBA_VS_REF_ATOL


@pytest.mark.parametrize("impl", ["numba", "ref"])
@pytest.mark.parametrize("block", [128, 64])
def test_cpu_experts_take_the_checkpoint_block(block, impl, monkeypatch):
    """FP8 experts quantised in 64-wide blocks (a checkpoint's `weight_block_size`) run on the
    CPU kernel with that block, as the plain loop over dequantised experts does."""
    monkeypatch.setenv("GLMFLASH_KERNEL_CPU_MOE", impl)
    config = SimpleNamespace(n_routed_experts=4, hidden_size=256, moe_intermediate_size=192,
                             swiglu_limit=7.0)
    experts = Experts(config, torch.float32, fp8_block=block)
    g = torch.Generator().manual_seed(0)
    for proj in experts.projections():
        codes, scales = quantize_block_fp8(torch.randn(proj.weight.shape, generator=g) * 0.1,
                                           block=block)
        proj.weight.data.copy_(codes)
        proj.weight_scale_inv.data.copy_(scales)
    x = torch.randn(3, 256, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.rand(3, 2, generator=g) + 0.1
    want = experts_loop(x, ids, weights, experts.projections(), experts.limit)
    got = experts(x, ids, weights)
    assert type(experts.cpu_kernel).__name__ == ("NumbaMoeExperts" if impl == "numba"
                                                 else "RefMoeExperts")
    # Same fp32 products, sums in another order: measured at most 4.4e-7 of the largest output.
    assert (got - want).abs().max().item() < 1e-5 * want.abs().max().item()
