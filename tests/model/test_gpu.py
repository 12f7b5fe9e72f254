"""Whole model on the GPU (kernels dispatched by device) vs the CPU reference, tiny checkpoint."""

from __future__ import annotations

import pytest
import torch

from glmflash import Engine, SamplingParams
from tests.conftest import PackedRunner, load_tiny
from tests.oracle import assert_greedy_matches

pytestmark = pytest.mark.gpu

# fp32 on the GPU: TF32 is off for matmuls by default, so only summation order differs.
FP32_ATOL = 1e-3
# bf16 on both sides (GPU kernels vs CPU reference): rounding differs at every layer and the
# random tiny model amplifies it; spec/model.md §9.3 measured bf16 vs fp32 max |d| of 3.8.
# So bf16 is checked by the mean difference and argmax agreement, as measured on the H200.
BF16_MEAN_ATOL = 0.05
BF16_ARGMAX_AGREE = 0.9


def _run_both(path, dtype, prompts, step):
    cpu = PackedRunner(load_tiny(path, dtype), 3)
    gpu = PackedRunner(load_tiny(path, dtype), 3, device="cuda")
    want = [cpu.forward(dict(enumerate(prompts))), cpu.forward(step)]
    got = [gpu.forward(dict(enumerate(prompts))).cpu(), gpu.forward(step).cpu()]
    return torch.cat(got), torch.cat(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", ["embedded", "kpool16"])
def test_gpu_logits_match_cpu(tiny_dirs, variant, dtype):
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (150, 37, 1)]
    # A prefill, then a chunk and decode steps on top of the cached state.
    got, want = _run_both(tiny_dirs[variant], dtype, prompts, {0: [7, 8, 9], 1: [4], 2: [5, 6]})
    diff = (got - want).abs()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"{variant} {dtype}: max {diff.max():.3e} mean {diff.mean():.3e} argmax {agree:.3f}")
    if dtype == torch.float32:
        assert diff.max().item() < FP32_ATOL
    else:
        assert diff.mean().item() < BF16_MEAN_ATOL and agree >= BF16_ARGMAX_AGREE


def test_engine_on_gpu_matches_oracle_greedy(tiny_dirs, oracles):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = ["The quick brown fox", "Hello", "A much longer prompt " * 8]
    engine = Engine(tiny_dirs["embedded"], device="cuda", dtype="float32", context_length=512)
    try:
        for prompt, result in zip(prompts, engine.generate(prompts, params)):
            assert_greedy_matches(oracles["embedded"], result.prompt_token_ids, result.token_ids)
    finally:
        engine.shutdown()
