"""The warp-specialised Gluon FP8 GEMM (fp8_gemm/gluon_sm90.py) and the MoE form built on it
(fused_moe/gluon_w8a8.py): on an SM90 GPU against the PyTorch emulation of the W8A8 numerics
and the fp32 references; the row gather it needs also in the interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmflash.kernels.fp8_gemm import gluon_sm90, quantize_block_fp8
from glmflash.kernels.fused_moe import triton_impl
from glmflash.kernels.fused_moe.gluon_w8a8 import GLUON_W8A8_CONFIG, gather_rows, gluon_fits
from glmflash.kernels.fused_moe.triton_impl import sort_pairs
from tests.kernels.test_fused_moe import _release_case, make_routing, norm_error
from tests.kernels.test_fused_moe_w8a8 import W8A8_CLAMPED_REL, check_release
from tests.kernels.w8a8_emulation import w8a8_linear_emulated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GLUON = GLUON_W8A8_CONFIG
# Dense GEMM against the emulation (fp32 products of the dequantised operands): only the
# summation order and the bf16 output differ.
GEMM_BF16_REL = 1e-2


def _sm90() -> bool:
    return torch.cuda.is_available() and gluon_sm90.available(torch.device("cuda"))


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel needs an SM90 GPU")


@pytest.mark.skipif(gluon_sm90.gluon is None, reason="this Triton has no Gluon")
def test_compiles_for_sm90_without_spills_or_serialised_wgmma():
    """tools/gluon_check.py in its own process (it installs a stand-in driver): every
    epilogue form compiles for sm_90 with the installed Triton, ptxas spills nothing and
    leaves the wgmma asynchronous, and no wgmma sequence waits on a load of its own step."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "gluon_check.py"
    done = subprocess.run([sys.executable, str(tool)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_gluon_only_where_it_fits():
    """Never on the CPU or the interpreter; 16-bit x and whole 128-wide scale blocks only."""
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    assert not gluon_fits(x, 256, 256, 128)
    if _sm90():
        x = x.cuda()
        assert gluon_fits(x, 4096, 2048, 128)
        assert not gluon_fits(x.float(), 4096, 2048, 128)
        assert not gluon_fits(x, 4096, 2048 + 64, 128)
        assert not gluon_fits(x, 4096, 2048, 64)


def test_gather_rows_copies_each_pairs_token(seeded):
    """Sorted rows get their token's codes and scales (scales K-block-major); padding rows get
    zeros."""
    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, num_experts, hidden = 7, 3, 5, 384
    x = torch.randn(num_tokens, hidden, generator=gen)
    xq = x.to(torch.float8_e4m3fn).to(DEVICE)
    xs = torch.rand(num_tokens, hidden // 128, generator=gen).to(DEVICE)
    ids, _ = make_routing(num_tokens, top_k, num_experts, gen)
    sorted_pairs, block_expert = sort_pairs(ids.to(DEVICE), num_experts, 128)
    # Rows of unused blocks hold whatever was in memory: here pairs past the end.
    used = (block_expert >= 0).repeat_interleave(128)
    sorted_pairs[~used] = -7
    aq, a_s = gather_rows(xq, xs, sorted_pairs, block_expert, top_k)
    assert a_s.stride(0) == 1
    pairs = sorted_pairs.long().cpu()
    valid = (pairs >= 0) & (pairs < num_tokens * top_k)
    tokens = pairs[valid] // top_k
    assert torch.equal(aq.cpu()[valid].float(), xq.cpu()[tokens].float())
    assert torch.equal(a_s.cpu()[valid], xs.cpu()[tokens])
    padding = used.cpu() & ~valid
    assert not aq.cpu()[padding].float().any() and not a_s.cpu()[padding].any()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("m,k,n", [(2048, 4096, 1536), (300, 1536, 640), (129, 512, 256),
                                   (200, 128, 384), (260, 384, 256), (2100, 640, 1280)])
def test_dense_gemm_matches_emulation(m, k, n):
    """Full and partial row tiles; K of 1, 3, 4, 5 to 32 blocks (the K loop takes its steps in
    pairs, then an odd one); 170 tiles at 2100 x 1280 with K of 5 blocks, more than the H200's
    132 SMs, so a program's later tiles start mid-ring."""
    from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations

    x = torch.randn(m, k, device="cuda").bfloat16()
    wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda") * 0.05)
    xq, xs = quantize_activations(x, wq.dtype, 128, scales_m_major=True)
    got = gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16)
    want = w8a8_linear_emulated(x, wq, ws)
    assert norm_error(got.float(), want) <= GEMM_BF16_REL


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("num_tokens,num_experts", [(8192, 288), (512, 16), (37, 16)])
def test_moe_matches_emulation_and_ref(num_tokens, num_experts):
    """Release width; many tokens per expert, a few, and experts with no token."""
    x, ids, weights, experts = _release_case(num_tokens, num_experts=num_experts)
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=GLUON)
    check_release(got, x, ids, weights, experts)


@pytest.mark.gpu
@needs_sm90
def test_moe_same_bits_as_triton_w8a8_and_the_default_on_sm90():
    """Each row's products, promotions and h quantisation are the Triton W8A8 form's: the
    outputs are equal; prefill on SM90 takes the Gluon form."""
    x, ids, weights, experts = _release_case(2048, num_experts=64)
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=GLUON)
    triton_w8a8 = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0,
                                        config=triton_impl.DEFAULT_DISPATCH.w8a8)
    assert torch.equal(got, triton_w8a8)
    assert triton_impl.default_config(ids.numel(), 64, x, True, 128, inter=2048) == GLUON


@pytest.mark.gpu
@needs_sm90
def test_moe_clamps_bind_and_pairs_skipped():
    x, ids, weights, experts = _release_case(300, num_experts=16)
    ids[::5, 1] = -1
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=0.3, config=GLUON)
    check_release(got, x, ids, weights, experts, limit=0.3, ref_rel=W8A8_CLAMPED_REL)


@pytest.mark.gpu
@needs_sm90
def test_a_program_per_tile_gives_the_same_bits():
    """A program per tile instead of a program per SM walking the tiles (the default) changes
    when things happen, not what is summed: dense (several tiles a program, a partial last row
    tile) and the MoE form (many unused blocks to walk past) equal the default bit for bit."""
    from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations
    from glmflash.kernels.fused_moe.gluon_w8a8 import GluonMoeConfig

    config = gluon_sm90.GluonGemmConfig(persistent=False)
    for m, k, n in [(2048, 4096, 1536), (300, 1536, 640)]:
        x = torch.randn(m, k, device="cuda").bfloat16()
        wq, ws = quantize_block_fp8(torch.randn(n, k, device="cuda") * 0.05)
        xq, xs = quantize_activations(x, wq.dtype, 128, scales_m_major=True)
        assert torch.equal(gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16, config=config),
                           gluon_sm90.gemm(xq, xs, wq, ws, torch.bfloat16))
    for num_tokens, num_experts in [(2048, 64), (37, 16)]:
        x, ids, weights, experts = _release_case(num_tokens, num_experts=num_experts)
        got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0,
                                    config=GluonMoeConfig(gemm=config))
        want = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=GLUON)
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("hidden,inter", [(384, 640), (128, 256)])
def test_moe_odd_k_steps_same_bits_as_triton_w8a8(hidden, inter):
    """Gate and up over 3 (or 1) K blocks and down over 5 (or 2): odd step counts, so the gated
    form's tiles (twice the steps through a 4-slot ring) start mid-ring; equal bit for bit
    to the Triton W8A8 form."""
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts = 700, 24
    experts = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        experts += quantize_block_fp8(torch.randn(num_experts, n, k, generator=gen).cuda() * 0.05)
    x = torch.randn(num_tokens, hidden, generator=gen).cuda().bfloat16()
    ids, weights = make_routing(num_tokens, 8, num_experts, gen)
    got = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0, config=GLUON)
    want = triton_impl.fused_moe(x, ids, weights, *experts, limit=10.0,
                                 config=triton_impl.DEFAULT_DISPATCH.w8a8)
    assert torch.equal(got, want)
