"""Triton clamped SwiGLU over a stacked [gate | up] product against swiglu/ref.py (interpreter
on the CPU, compiled with CUDA), and the MLP that feeds it one product over its stacked gate and
up weights (plain and block-FP8) against the two products it replaces."""

from __future__ import annotations

import os

import pytest
import torch

from glmflash.kernels.fp8_gemm.ref import quantize_block_fp8
from glmflash.kernels.swiglu import clamped_swiglu_ref
from glmflash.kernels.swiglu import clamped_swiglu_stacked as dispatched
from glmflash.kernels.swiglu.triton_impl import clamped_swiglu_stacked
from glmflash.model.layers import MLP, stacked_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
LIMIT = 7.0


def _gate_up(rows: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 1000 + width)
    # Values past the limit on both sides, so every clamp binds somewhere.
    return (torch.randn(rows, 2 * width, generator=gen) * 6).to(dtype).to(DEVICE)


@pytest.mark.parametrize("shape", [(1, 64), (3, 1000), (2, 2500)],
                         ids=["one-row", "tail", "blocks-and-tail"])
def test_fp32_matches_the_reference(shape, nan_empty):
    gate_up = _gate_up(*shape, torch.float32)
    assert (gate_up.abs() > LIMIT).any()
    got = clamped_swiglu_stacked(gate_up, LIMIT)
    want = clamped_swiglu_ref(*gate_up.chunk(2, dim=-1), LIMIT)
    # exp and the division in another order: a few fp32 ulps.
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


def test_bf16_rounds_like_the_reference(nan_empty):
    """Two roundings as torch's ops (the silu, then the product): at most one ulp each where the
    silu's last bit differs (the interpreter truncates, the GPU rounds to nearest)."""
    gate_up = _gate_up(5, 700, torch.bfloat16)
    got = clamped_swiglu_stacked(gate_up, LIMIT).float()
    want = clamped_swiglu_ref(*gate_up.chunk(2, dim=-1), LIMIT).float()
    ulp = want.abs().clamp(min=1e-30) * 2.0 ** -7
    assert ((got - want).abs() <= 2 * ulp).all()
    if not INTERPRETED:
        assert (got == want).float().mean() > 0.99


def test_nan_stays_nan(nan_empty):
    """A NaN in the gate or the up half gives NaN there, as torch's clamps give it (Triton's
    min / max would return the limit), and nowhere else."""
    gate_up = _gate_up(2, 64, torch.float32)
    gate_up[0, 3] = float("nan")
    gate_up[1, 64 + 7] = float("nan")
    got = clamped_swiglu_stacked(gate_up, LIMIT)
    want = clamped_swiglu_ref(*gate_up.chunk(2, dim=-1), LIMIT)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().sum() == 2


def test_leading_dims_and_the_cpu_dispatch():
    gate_up = _gate_up(6, 96, torch.float32).view(2, 3, 192)
    got = clamped_swiglu_stacked(gate_up, LIMIT)
    assert got.shape == (2, 3, 96)
    torch.testing.assert_close(got, dispatched(gate_up.cpu(), LIMIT).to(got.device), rtol=2e-6,
                               atol=1e-6)


def _mlp(fp8: bool, dtype: torch.dtype = torch.float32) -> MLP:
    gen = torch.Generator().manual_seed(1)
    mlp = MLP(64, 256, LIMIT, dtype, 128 if fp8 else None)
    for linear in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        weight = torch.randn(linear.weight.shape, generator=gen) * 0.2
        if fp8:
            codes, scales = quantize_block_fp8(weight, block=128)
            linear.weight.data.copy_(codes)
            linear.weight_scale_inv.data.copy_(scales)
        else:
            linear.weight.data.copy_(weight)
    return mlp


@pytest.mark.parametrize("fp8", [False, True], ids=["plain", "fp8"])
def test_mlp_takes_one_stacked_product(fp8):
    """The stacked product equals the gate and up products it replaces, the parameters become
    views of the stacked tensors (one copy, the same state dict), and it is built once."""
    mlp = _mlp(fp8)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = mlp.down_proj(clamped_swiglu_ref(mlp.gate_proj(x), mlp.up_proj(x), LIMIT))
        keys = set(mlp.state_dict())
        got = mlp(x)
    joined = stacked_linear((mlp.gate_proj, mlp.up_proj))
    assert joined is stacked_linear((mlp.gate_proj, mlp.up_proj))
    assert mlp.gate_proj.weight.data_ptr() == joined.weight.data_ptr()
    assert mlp.up_proj.weight.untyped_storage().data_ptr() == joined.weight.data_ptr()
    assert set(mlp.state_dict()) == keys
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_release_width_bf16_gpu():
    gate_up = _gate_up(4, 2048, torch.bfloat16)
    got = clamped_swiglu_stacked(gate_up, LIMIT).float()
    want = clamped_swiglu_ref(*gate_up.chunk(2, dim=-1), LIMIT).float()
    ulp = want.abs().clamp(min=1e-30) * 2.0 ** -7
    assert ((got - want).abs() <= 2 * ulp).all() and (got == want).float().mean() > 0.99


def test_stack_weights_builds_them_before_any_forward():
    """`stack_weights(model)` (run after loading and placing) builds each module's stacked
    weights: the forward then finds them, and nothing is stacked under inference mode."""
    from glmflash.model.layers import stack_weights

    mlp = _mlp(fp8=True)
    stack_weights(torch.nn.Sequential(mlp))
    joined = mlp.stack_weights()
    assert mlp.gate_proj.weight.data_ptr() == joined.weight.data_ptr()
    assert not joined.weight.is_inference()
    with torch.inference_mode():
        mlp(torch.randn(2, 64))
    assert mlp.stack_weights() is joined


@pytest.mark.parametrize("rows", [1, 5, 40], ids=["one-row-fma", "codes", "products"])
@pytest.mark.parametrize("width", [200, 1100], ids=["ragged", "split-k"])
def test_fp8_linear_forms_the_swiglu_as_it_reads(rows, width, nan_empty):
    """The FP8 linear of a stacked [gate | up] product with `swiglu_limit` gives the bits of
    the SwiGLU launch followed by the linear (on the GPU, 40 rows take the W8A8 form after
    the SwiGLU launch), and the dispatcher's reference path the reference's."""
    from glmflash.kernels import fp8_gemm
    from glmflash.kernels.fp8_gemm import triton_impl as fp8_triton

    gate_up = _gate_up(rows, width, torch.bfloat16)
    codes, scales = quantize_block_fp8(torch.randn(96, width) * 0.1, block=128)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    got = fp8_triton.fp8_linear(gate_up, codes, scales, swiglu_limit=LIMIT)
    want = fp8_triton.fp8_linear(clamped_swiglu_stacked(gate_up, LIMIT), codes, scales)
    assert torch.equal(got, want)
    if DEVICE == "cpu":
        ref = fp8_gemm.fp8_linear(gate_up, codes, scales, swiglu_limit=LIMIT)
        assert torch.equal(ref, fp8_gemm.fp8_linear_ref(
            clamped_swiglu_ref(*gate_up.chunk(2, dim=-1), LIMIT), codes, scales))


def test_mlp_down_projection_takes_the_stacked_product(monkeypatch):
    """On the Triton FP8 path the MLP launches no SwiGLU of its own at one row: the down
    projection forms it, with the bits of the launch it replaces."""
    from glmflash.kernels.swiglu import triton_impl as swiglu_triton

    monkeypatch.setenv("GLMFLASH_KERNEL_FP8_GEMM", "triton")
    monkeypatch.setenv("GLMFLASH_KERNEL_SWIGLU", "triton")
    mlp = _mlp(fp8=True, dtype=torch.bfloat16)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.no_grad():
        gate_up = mlp.stack_weights()(x)
        want = mlp.down_proj(clamped_swiglu_stacked(gate_up, LIMIT))
        monkeypatch.setattr(swiglu_triton, "swiglu_kernel", None)  # a launch would fail
        got = mlp(x)
    assert torch.equal(got, want)
