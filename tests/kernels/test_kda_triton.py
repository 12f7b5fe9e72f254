"""Triton KDA (conv, decode step, chunked prefill) against kda/ref.py.

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes; with CUDA they compile,
and the `gpu` tests add release shapes (64 heads x 128, bf16).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glmflash.kernels.kda import causal_conv1d_ref, kda_ref  # noqa: E402
from glmflash.kernels.kda.triton_impl import causal_conv1d, kda  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 inputs: worst measured 3e-7 (outputs) / 2e-6 (state, |S| ~ 10) in the interpreter.
FP32_TOL = 1e-5
# bf16 inputs and intermediates (TF32/bf16 products) vs the fp32 reference: measured <= 4e-3
# relative on the outputs; the state is kept in fp32.
BF16_REL = 2e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _kda_inputs(lens, heads, dim, dtype, decay=1.0, seed=42):
    gen = torch.Generator().manual_seed(seed)
    num = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = (rnd(num, heads, dim).to(dtype) for _ in range(3))
    # The release gate: lower bound -5, g in (-5, 0); `decay` > 1 exercises steep decays.
    g = -5 * torch.sigmoid(rnd(num, heads, dim)) * decay
    beta = torch.sigmoid(rnd(num, heads)).to(dtype)
    state = rnd(len(lens) + 2, heads, dim, dim)
    return [t.to(DEVICE) for t in (q, k, v, g, beta, state)]


def _run_kda(lens, heads, dim, dtype, decay=1.0):
    q, k, v, g, beta, state = _kda_inputs(lens, heads, dim, dtype, decay)
    cu = _cu(lens)
    slots = [(3 * b + 1) % (len(lens) + 2) for b in range(len(lens))]
    fresh = [b % 3 == 1 for b in range(len(lens))]
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(q, k, v, g, beta, s_ref, cu, slots, fresh)
    got = kda(q, k, v, g, beta, s_got, cu, slots, fresh)
    return got, want, s_got, s_ref


KDA_CASES = {
    "decode1": [1],
    "decode3": [1, 1, 1],
    "decode17_wide_blocks": [1] * 17,  # decode_wide_batch or more: the wide launch shape
    "len5": [5],
    "len15": [15],
    "len63": [63],
    "len64": [64],
    "len65": [65],
    "len130": [130],
    "mixed": [65, 1, 17, 0, 2],
}


@pytest.mark.parametrize("lens", KDA_CASES.values(), ids=KDA_CASES.keys())
def test_kda_fp32_matches_ref(lens, nan_empty):
    got, want, s_got, s_ref = _run_kda(lens, heads=2, dim=32, dtype=torch.float32)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


def test_kda_prep_inverse_over_several_chunks_matches_ref(nan_empty):
    # the (I + A)^-1 of the prep kernel (squaring products) on whole, partial and single chunks
    got, want, s_got, s_ref = _run_kda([130, 1, 64, 17], heads=2, dim=32, dtype=torch.float32)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


def test_kda_head_dim16_and_steep_decay(nan_empty):
    # g down to -20 per step: the diagonal blocks take the column-by-column fallback.
    got, want, s_got, s_ref = _run_kda([40, 1, 70], heads=3, dim=16, dtype=torch.float32,
                                       decay=4.0)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


def test_kda_bf16_inputs(nan_empty):
    got, want, s_got, s_ref = _run_kda([70, 1, 9], heads=2, dim=32, dtype=torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert _rel(got, want) < BF16_REL
    assert _rel(s_got, s_ref) < BF16_REL


def test_kda_strided_qkv_views(nan_empty):
    """q, k, v as channel slices of one [T, 3C] tensor, as the model passes them."""
    lens, heads, dim = [20, 1], 2, 16
    q, k, v, g, beta, state = _kda_inputs(lens, heads, dim, torch.float32)
    mixed = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    qs, ks, vs = (t.view(-1, heads, dim) for t in mixed.chunk(3, dim=-1))
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(q, k, v, g, beta, s_ref, _cu(lens), [0, 1], [False, True])
    got = kda(qs, ks, vs, g, beta, s_got, _cu(lens), [0, 1], [False, True])
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


CONV_CASES = {
    "decode": ([1, 1, 1], 48),
    "short": ([5, 2], 40),
    "long_mixed_empty": ([70, 1, 3, 0], 96),
    "block_edge": ([64, 65], 24),
    "conv_block_edge": ([32, 33], 24),  # conv_tokens: one fused block, then two blocks
}


@pytest.mark.parametrize("lens,channels", CONV_CASES.values(), ids=CONV_CASES.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_conv1d_matches_ref(lens, channels, dtype, nan_empty):
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, 4, generator=gen).to(DEVICE)
    state = torch.randn(len(lens) + 1, channels, 3, generator=gen).to(dtype).to(DEVICE)
    slots = list(range(len(lens), 0, -1))
    fresh = [b % 2 == 0 for b in range(len(lens))]
    s_ref, s_got = state.clone(), state.clone()
    want = causal_conv1d_ref(x, weight, s_ref, _cu(lens), slots, fresh)
    got = causal_conv1d(x, weight, s_got, _cu(lens), slots, fresh)
    # fp32: summation order only (measured 5e-7); bf16: one output ulp (measured 0.06 at |y|~8).
    atol = 1e-5 if dtype == torch.float32 else 0.07
    assert (got.float() - want.float()).abs().max().item() < atol
    assert torch.equal(s_got, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1] * 8, [1] * 32, [4096], [1000, 1, 3000, 64, 1, 129]],
                         ids=["decode8", "decode32", "prefill4k", "mixed"])
def test_kda_release_shape_gpu(lens):
    got, want, s_got, s_ref = _run_kda(lens, heads=64, dim=128, dtype=torch.bfloat16)
    assert _rel(got, want) < BF16_REL
    assert _rel(s_got, s_ref) < BF16_REL


@pytest.mark.gpu
def test_kda_prep_inverse_release_shape_gpu():
    got, want, s_got, s_ref = _run_kda([1000, 1, 3000, 64, 1, 129], heads=64, dim=128,
                                       dtype=torch.bfloat16)
    assert _rel(got, want) < BF16_REL
    assert _rel(s_got, s_ref) < BF16_REL


@pytest.mark.gpu
def test_kda_release_shape_fp32_gpu():
    got, want, s_got, s_ref = _run_kda([300, 1, 77], heads=64, dim=128, dtype=torch.float32)
    assert _rel(got, want) < 1e-5
    assert _rel(s_got, s_ref) < 1e-5


@pytest.mark.gpu
def test_causal_conv1d_release_shape_gpu():
    lens, channels = [1, 2000, 1, 5], 3 * 8192
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(sum(lens), channels, generator=gen).bfloat16().cuda()
    weight = torch.randn(channels, 4, generator=gen).cuda()
    state = torch.randn(6, channels, 3, generator=gen).bfloat16().cuda()
    s_ref, s_got = state.clone(), state.clone()
    want = causal_conv1d_ref(x, weight, s_ref, _cu(lens), [0, 3, 5, 1], [False, True, False, True])
    got = causal_conv1d(x, weight, s_got, _cu(lens), [0, 3, 5, 1], [False, True, False, True])
    assert _rel(got, want) < 1e-2
    assert torch.equal(s_got, s_ref)


def test_dispatch_override(monkeypatch):
    """CPU tensors take the reference unless GLMFLASH_KERNEL_KDA says otherwise."""
    import glmflash.kernels.kda as ops

    lens = [3, 1]
    q, k, v, g, beta, state = (t.cpu() for t in _kda_inputs(lens, 2, 16, torch.float32))
    args = (q, k, v, g, beta)
    want = ops.kda(*args, state.clone(), _cu(lens), [0, 1], [True, False])
    monkeypatch.setenv("GLMFLASH_KERNEL_KDA", "triton")
    if not torch.cuda.is_available():
        got = ops.kda(*args, state.clone(), _cu(lens), [0, 1], [True, False])
        assert (got - want).abs().max().item() < FP32_TOL
    monkeypatch.setenv("GLMFLASH_KERNEL_KDA", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        ops.kda(*args, state.clone(), _cu(lens), [0, 1], [True, False])
