"""Triton RMSNorm against rms_norm/ref.py: interpreter on CPU, compiled with CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.rms_norm import rms_norm_ref
from glmflash.kernels.rms_norm.triton_impl import RmsNormConfig, rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(shape, dtype, with_weight=True, seed=42):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(dtype).to(DEVICE) \
        if with_weight else None
    return x, w


@pytest.mark.parametrize("shape", [(1, 64), (3, 200), (17, 192), (2, 5, 96)],
                         ids=["one-row", "odd-width", "rows-17", "3d"])
@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_rms_norm_fp32_matches_ref(shape, rows_per_program, nan_empty):
    x, w = _inputs(shape, torch.float32)
    got = rms_norm(x, w, 1e-5, config=RmsNormConfig(rows_per_program))
    want = rms_norm_ref(x, w, 1e-5)
    assert got.shape == want.shape and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_bf16_rounds_like_ref(with_weight, nan_empty):
    """Two roundings as the reference: the normalised row may round one bf16 ulp apart
    (summation order), which the weight product carries into a second rounding; the
    interpreter truncates instead of rounding. So at most one ulp per rounding."""
    x, w = _inputs((33, 320), torch.bfloat16, with_weight)
    got, want = rms_norm(x, w, 1e-6).float(), rms_norm_ref(x, w, 1e-6).float()
    ulp = want.abs().clamp(min=1e-30) * 2.0 ** -7
    assert ((got - want).abs() <= (1 + with_weight) * ulp).all()
    if DEVICE == "cuda":
        assert (got == want).float().mean() > 0.99


@pytest.mark.gpu
def test_rms_norm_release_width_gpu():
    x, w = _inputs((2048, 4096), torch.bfloat16)
    got, want = rms_norm(x, w, 1e-5).float(), rms_norm_ref(x, w, 1e-5).float()
    # One ulp per rounding (see test_rms_norm_bf16_rounds_like_ref), almost always none.
    assert ((got - want).abs() <= 2 * want.abs() * 2.0 ** -7).all()
    assert (got == want).float().mean() > 0.99


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_pair_equals_two_norms_and_a_scatter(dtype, nan_empty):
    """MLA's two down-projection norms in one launch: the first half's norm returned, the
    second's written into the cache rows named (others untouched), each bit for bit the
    single-norm kernel's; the CPU dispatch is the reference's two norms and an index write."""
    from glmflash.kernels.rms_norm import rms_norm_pair
    from glmflash.kernels.rms_norm.triton_impl import rms_norm_pair as pair_triton

    x, w_a = _inputs((5, 96 + 40), dtype)
    w_a = w_a[:96].contiguous()
    w_b = (1 + 0.3 * torch.randn(40, generator=torch.Generator().manual_seed(3))).to(x)
    # A column of a wider tensor: the rows' index is read with its stride.
    rows = torch.tensor([[7, 1], [0, 1], [3, 1], [9, 1], [4, 1]], device=DEVICE)[:, 0]
    cache = torch.full((10, 40), float("nan"), dtype=dtype, device=DEVICE)
    want_cache = cache.clone()
    got = pair_triton(x, w_a, 1e-5, w_b, 1e-6, cache, rows)
    want_cache[rows] = rms_norm(x[:, 96:], w_b, 1e-6)
    assert torch.equal(got, rms_norm(x[:, :96], w_a, 1e-5))
    assert torch.equal(cache.float().nan_to_num(7.0), want_cache.float().nan_to_num(7.0))
    assert cache[[1, 2, 5, 6, 8]].isnan().all()
    if DEVICE == "cpu":
        ref_cache = torch.zeros_like(cache)
        out = rms_norm_pair(x, w_a, 1e-5, w_b, 1e-6, ref_cache, rows)
        assert torch.equal(out, rms_norm_ref(x[:, :96], w_a, 1e-5))
        assert torch.equal(ref_cache[rows], rms_norm_ref(x[:, 96:], w_b, 1e-6))
