"""The tiny model with the numba CPU experts == with the reference experts (all-CPU mode)."""

from __future__ import annotations

import pytest
import torch

from glmflash.model.moe import Experts
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
