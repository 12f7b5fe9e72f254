"""Triton KDA conv and decode step against kda/ref.py (the chunked prefill:
test_kda_prefill.py).

Without CUDA the kernels run under TRITON_INTERPRET=1 on small shapes; with CUDA they compile,
and the `gpu` tests add release shapes (64 heads x 128, bf16).
"""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.kda import causal_conv1d_ref, kda_ref, triton_impl
from glmflash.kernels.kda.triton_impl import causal_conv1d, kda
from tests.kernels.kda_cases import (
    DEVICE,
    assert_bf16_close,
    cu_seqlens,
    kda_inputs,
    rel_err,
    run_kda,
)

# fp32 inputs: worst measured 4e-8 (outputs) / 4e-7 (state, |S| ~ 10) in the interpreter.
FP32_TOL = 1e-5

DECODE_CASES = {
    "decode1": [1],
    "decode3": [1, 1, 1],
    "decode17_wide_blocks": [1] * 17,  # decode_wide_batch or more: the wide launch shape
}


@pytest.mark.parametrize("lens", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_kda_decode_fp32_matches_ref(lens, nan_empty):
    got, want, s_got, s_ref = run_kda(lens, heads=2, dim=32, dtype=torch.float32)
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


def test_kda_strided_qkv_views(nan_empty):
    """q, k, v as channel slices of one [T, 3C] tensor, as the model passes them."""
    lens, heads, dim = [20, 1], 2, 16
    q, k, v, g, beta, state = kda_inputs(lens, heads, dim, torch.float32)
    mixed = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    qs, ks, vs = (t.view(-1, heads, dim) for t in mixed.chunk(3, dim=-1))
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(q, k, v, g, beta, s_ref, cu_seqlens(lens), [0, 1], [False, True])
    got = kda(qs, ks, vs, g, beta, s_got, cu_seqlens(lens), [0, 1], [False, True])
    assert (got - want).abs().max().item() < FP32_TOL
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)


@pytest.mark.parametrize("impl", ["triton", "dispatch"])
def test_decode_rows_read_and_written_in_place(impl):
    """A verify's position: the meta names rows 3 and 0 of a 5-row batch; only those rows of
    `out` are written (the rest stay NaN), each from its own inputs, as the reference gives
    for the two rows alone; the conv step the same."""
    import glmflash.kernels.kda as dispatch
    from glmflash.kernels.kda import triton_impl

    module = triton_impl if impl == "triton" else dispatch
    if impl == "dispatch" and DEVICE != "cpu":
        pytest.skip("the dispatcher takes Triton on CUDA")
    q, k, v, g, beta, state = kda_inputs([1] * 5, heads=2, dim=16, dtype=torch.float32)
    rows, slots = [3, 0], [1, 4]
    meta = torch.tensor([[r, s, 0] for r, s in zip(rows, slots, strict=True)], dtype=torch.int32,
                        device=DEVICE)
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(q[rows], k[rows], v[rows], g[rows], beta[rows], s_ref, [0, 1, 2], slots,
                   [False, False])
    out = torch.full((5, 2, 16), float("nan"), device=DEVICE)
    module.kda_decode(q, k, v, g, beta, s_got, meta, out)
    assert (out[rows] - want).abs().max().item() < FP32_TOL
    assert out[[1, 2, 4]].isnan().all()
    assert torch.allclose(s_got, s_ref, atol=FP32_TOL * 10, rtol=FP32_TOL)

    x = torch.randn(5, 24, device=DEVICE)
    weight = torch.randn(24, 4, device=DEVICE)
    conv = torch.randn(5, 24, 3, device=DEVICE)
    c_ref, c_got = conv.clone(), conv.clone()
    conv_meta = torch.tensor([[r, r, r + 1, s, 0] for r, s in zip(rows, slots, strict=True)],
                             dtype=torch.int32, device=DEVICE)
    want = causal_conv1d_ref(x[rows], weight, c_ref, [0, 1, 2], slots, [False, False])
    out = torch.full_like(x, float("nan"))
    module.causal_conv1d_decode(x, weight, c_got, conv_meta, out)
    assert (out[rows] - want).abs().max().item() < FP32_TOL
    assert out[[1, 2, 4]].isnan().all()
    assert torch.allclose(c_got, c_ref, atol=FP32_TOL)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["lower_bound", "softplus"])
def test_decode_forms_the_gates_bit_for_bit(lower_bound):
    """With GateParams the decode step takes f and b and forms g and beta itself: the same
    output and state bits as kda_gates, then the step on its g and beta."""
    from glmflash.kernels.kda.gates_triton import kda_gates
    from glmflash.kernels.kda.ref import GateParams

    q, k, v, _, _, state = kda_inputs([1] * 3, heads=2, dim=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    f = (torch.randn(3, 32, generator=gen) * 4).bfloat16().to(DEVICE)
    b = torch.randn(3, 2, generator=gen).bfloat16().to(DEVICE)
    params = GateParams(torch.randn(32, generator=gen).to(DEVICE),
                        torch.randn(2, generator=gen).to(DEVICE), lower_bound)
    meta = torch.tensor([[2, 1, 0], [0, 3, 1], [1, 0, 0]], dtype=torch.int32, device=DEVICE)
    g, beta = kda_gates(f, params.dt_bias, params.a_log, b, lower_bound)
    s_want, s_got = state.clone(), state.clone()
    want = triton_impl.kda_decode(q, k, v, g, beta, s_want, meta)
    got = triton_impl.kda_decode(q, k, v, f, b, s_got, meta, gates=params)
    assert torch.equal(got, want) and torch.equal(s_got, s_want)


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
    want = causal_conv1d_ref(x, weight, s_ref, cu_seqlens(lens), slots, fresh)
    got = causal_conv1d(x, weight, s_got, cu_seqlens(lens), slots, fresh)
    # fp32: summation order only (measured 5e-7); bf16: one output ulp (measured 0.06 at |y|~8).
    atol = 1e-5 if dtype == torch.float32 else 0.07
    assert (got.float() - want.float()).abs().max().item() < atol
    assert torch.equal(s_got, s_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1] * 8, [1] * 32], ids=["decode8", "decode32"])
def test_kda_decode_release_shape_gpu(lens):
    assert_bf16_close(*run_kda(lens, heads=64, dim=128, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_causal_conv1d_release_shape_gpu():
    lens, channels = [1, 2000, 1, 5], 3 * 8192
    gen = torch.Generator().manual_seed(42)
    x = torch.randn(sum(lens), channels, generator=gen).bfloat16().cuda()
    weight = torch.randn(channels, 4, generator=gen).cuda()
    state = torch.randn(6, channels, 3, generator=gen).bfloat16().cuda()
    s_ref, s_got = state.clone(), state.clone()
    cu, slots, fresh = cu_seqlens(lens), [0, 3, 5, 1], [False, True, False, True]
    want = causal_conv1d_ref(x, weight, s_ref, cu, slots, fresh)
    got = causal_conv1d(x, weight, s_got, cu, slots, fresh)
    assert rel_err(got, want) < 1e-2
    assert torch.equal(s_got, s_ref)


def test_dispatch_override(monkeypatch):
    """CPU tensors take the reference unless GLMFLASH_KERNEL_KDA says otherwise."""
    import glmflash.kernels.kda as ops

    lens = [3, 1]
    q, k, v, g, beta, state = (t.cpu() for t in kda_inputs(lens, 2, 16, torch.float32))
    args = (q, k, v, g, beta)
    want = ops.kda(*args, state.clone(), cu_seqlens(lens), [0, 1], [True, False])
    monkeypatch.setenv("GLMFLASH_KERNEL_KDA", "triton")
    if not torch.cuda.is_available():
        got = ops.kda(*args, state.clone(), cu_seqlens(lens), [0, 1], [True, False])
        assert (got - want).abs().max().item() < FP32_TOL
    monkeypatch.setenv("GLMFLASH_KERNEL_KDA", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        ops.kda(*args, state.clone(), cu_seqlens(lens), [0, 1], [True, False])
