"""Whole model on the GPU (kernels dispatched by device) vs the CPU reference, tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from glmflash import Engine, SamplingParams
from tests.conftest import PackedRunner, load_tiny

pytestmark = pytest.mark.gpu

# fp32 on the GPU: TF32 is off by default for matmuls, so only kernel summation order differs.
FP32_ATOL = 1e-3
# bf16 weights and activations against fp32: logits of magnitude ~5 move by a few 1e-2.
BF16_ATOL = 0.15


@pytest.mark.parametrize("dtype,atol", [(torch.float32, FP32_ATOL), (torch.bfloat16, BF16_ATOL)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["embedded", "kpool16"])
def test_gpu_logits_match_cpu(tiny_dirs, variant, dtype, atol):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (150, 37, 1)]
    cpu = PackedRunner(load_tiny(tiny_dirs[variant]), 3)
    gpu = PackedRunner(load_tiny(tiny_dirs[variant], dtype), 3, device="cuda")
    want = cpu.forward(dict(enumerate(prompts)))
    got = gpu.forward(dict(enumerate(prompts))).cpu()
    assert (got - want).abs().max().item() < atol
    # Then a chunk and a decode step on top of the cached state.
    step = {0: [7, 8, 9], 1: [4], 2: [5, 6]}
    want = cpu.forward(step)
    got = gpu.forward(step).cpu()
    assert (got - want).abs().max().item() < atol


def test_engine_on_gpu_matches_cpu_greedy(tiny_dirs):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello", "A much longer prompt " * 8]
    cpu = Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=512)
    gpu = Engine(tiny_dirs["embedded"], device="cuda", dtype="float32", context_length=512)
    try:
        assert [r.token_ids for r in gpu.generate(prompts, params)] == \
            [r.token_ids for r in cpu.generate(prompts, params)]
    finally:
        cpu.shutdown()
        gpu.shutdown()
