"""Triton block-FP8 linear against fp8_gemm/ref.py (interpreter on CPU: weight-only path;
with CUDA both paths at release shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glmflash.kernels.fp8_gemm import (
    dequantize_block_fp8,
    fp8_linear_ref,
    quantize_block_fp8,
    triton_common,
    triton_impl,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m, n, k, dtype, block=128, seed=42):
    gen = torch.Generator().manual_seed(seed)
    weight, scale = quantize_block_fp8(torch.randn(n, k, generator=gen), block=block)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE), scale.to(DEVICE)


# The split_k shapes have few column blocks and K long enough for several K ranges, the last one
# ragged: their partial sums meet in the last range to finish.
SHAPES = {"1x70x200": (1, 70, 200), "5x130x257": (5, 130, 257), "17x128x128": (17, 128, 128),
          "3x129x127": (3, 129, 127), "1x16x1100_split_k": (1, 16, 1100),
          "18x130x1100_split_k": (18, 130, 1100),
          "70x130x1100_split_k_two_row_blocks": (70, 130, 1100)}  # masks of a ragged row block


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_weight_only_fp32_matches_ref(shape, nan_empty):
    x, w, s = _case(*shape, torch.float32)
    want = fp8_linear_ref(x, w, s)
    got = triton_impl.fp8_linear(x, w, s)
    # Same dequantised weights; fp32 summation order only (measured 2e-5 at |y| ~ 50).
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_weight_only_bf16_and_block64(nan_empty):
    x, w, s = _case(3, 256, 384, torch.bfloat16, block=64)
    want = fp8_linear_ref(x, w, s, block=64)
    got = triton_impl.fp8_linear_weight_only(x, w, s, 64)
    # One bf16 output rounding apart (measured 1 ulp: 0.25 at |y| ~ 60).
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.abs().max().item()


def test_weight_only_bf16_split_k(nan_empty):
    x, w, s = _case(2, 16, 640, torch.bfloat16)
    want = fp8_linear_ref(x, w, s)
    got = triton_impl.fp8_linear_weight_only(x, w, s, 128)
    assert got.dtype == torch.bfloat16
    # fp32 partial sums in another order, then one bf16 rounding: within 1 ulp.
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("fma_rows", [0, 1], ids=["products", "fma"])
def test_one_row_bf16_paths(fma_rows, nan_empty):
    config = dataclasses.replace(triton_impl.DEFAULT_CONFIG, wdq_fma_rows=fma_rows)
    x, w, s = _case(1, 130, 1100, torch.bfloat16)
    want = fp8_linear_ref(x.float(), w, s)
    got = triton_impl.fp8_linear(x, w, s, config=config).float()
    if fma_rows:
        # exact weights and fp32 sums: only the final cast to bf16, within one ulp of each
        # element (2^-7 relative; the interpreter truncates where the GPU rounds to nearest)
        assert ((got - want).abs() <= 2 ** -7 * want.abs() + 1e-5 * want.abs().max()).all()
    else:
        # the reference's bf16 rounding of every dequantised weight as well
        assert (got - want).abs().max().item() <= 2 ** -7 * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [2, 5, 16, 17, 32])
def test_codes_rows_have_exact_weights(m, dtype, nan_empty):
    """2-32 rows of 16-bit x (16- and 32-row tiles): the e4m3 codes enter the products as fp16
    and each K block's product is scaled once, so the result is x (in fp16) times the exact
    weights, rounded once (ragged columns and K, split over K)."""
    x, w, s = _case(m, 130, 1100, dtype)
    got = triton_impl.fp8_linear(x, w, s).float()
    exact = (x.half().double() @ dequantize_block_fp8(w, s).double().T).float()
    # One rounding to x's dtype (the interpreter truncates: a whole ulp), fp32 sums in another
    # order at the scale of the row.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    tol = ulp * exact.abs() + 1e-5 * exact.abs().amax(1, keepdim=True)
    assert ((got - exact).abs() <= tol).all()
    if dtype == torch.float16:
        return
    # bf16 x is rounded to fp16 on this path: far below fp16's smallest subnormal it is zero
    # (which also tells the path from the dequantising one, whose fp32 product keeps such x).
    tiny = x.float().mul(2.0 ** -40).to(dtype)
    assert triton_impl.fp8_linear(tiny, w, s).abs().max().item() == 0.0
    fewer = dataclasses.replace(triton_impl.DEFAULT_CONFIG, codes_max_rows=m - 1)
    assert triton_impl.fp8_linear(tiny, w, s, config=fewer).abs().max().item() > 0.0


def test_split_k_is_deterministic_and_leaves_counters_at_zero(nan_empty):
    x, w, s = _case(3, 200, 1100, torch.float32)
    first = triton_impl.fp8_linear(x, w, s)
    counters = triton_common.ARRIVALS[x.device]
    assert int(counters.count_nonzero()) == 0
    # A different split of the same product must land in the same counters without stale counts.
    triton_impl.fp8_linear(x[:1, :640], w[:, :640], s[:, :5])
    assert int(counters.count_nonzero()) == 0
    assert torch.equal(triton_impl.fp8_linear(x, w, s), first)


def test_leading_dims_and_empty():
    x, w, s = _case(6, 64, 128, torch.float32)
    got = triton_impl.fp8_linear(x.view(2, 3, 128), w, s)
    assert got.shape == (2, 3, 64)
    assert torch.allclose(got.view(6, 64), fp8_linear_ref(x, w, s), rtol=1e-4, atol=1e-3)
    assert triton_impl.fp8_linear(x[:0], w, s).shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (16, torch.bfloat16),
                                     (100, torch.float32)], ids=["1", "16", "100-fp32"])
def test_split_k_last_arrival_gpu(m, dtype):
    # Many tiles x K ranges running at once (fp32 keeps 100 rows on the weight-only path: two
    # row blocks): only on the GPU does the range that finishes last, and the order of row
    # blocks, vary from call to call (the interpreter runs programs one by one); the sum must not.
    x, w, s = _case(m, 1536, 16384, dtype)
    first = triton_impl.fp8_linear(x, w, s)
    for _ in range(20):
        assert torch.equal(triton_impl.fp8_linear(x, w, s), first)
    want = fp8_linear_ref(x.float(), w, s)
    # 16 bf16 rows take the fp16-codes form (exact weights, x in fp16): bf16 output rounding.
    assert ((first.float() - want).norm() / want.norm()).item() < 5e-3
    assert int(triton_common.ARRIVALS[x.device].count_nonzero()) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 16, 17, 32, 33, 2048])
@pytest.mark.parametrize("n,k", [(1536, 4096), (4096, 16384)], ids=["4096-1536", "16384-4096"])
def test_release_shapes_gpu(m, n, k):
    x, w, s = _case(m, n, k, torch.bfloat16)
    want = fp8_linear_ref(x.float(), w, s)
    got = triton_impl.fp8_linear(x, w, s).float()
    rel = ((got - want).norm() / want.norm()).item()
    # Weight-only (one row, and fp16 codes up to codes_max_rows): bf16 rounding (~3e-3); W8A8
    # (beyond): e4m3 activations add ~2-3%.
    assert rel < (5e-3 if m <= triton_impl.DEFAULT_CONFIG.codes_max_rows else 4e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 67, 2048])
def test_blockwise_scaled_mm_on_a_non_square_scale_grid_gpu(m):
    """cuBLAS's block-scaled GEMM with a 3 x 4 weight-scale grid (a transposed scale layout is
    silently accepted only on square grids) and M not a multiple of 4."""
    x, w, s = _case(m, 384, 512, torch.bfloat16)
    if not triton_impl.scaled_mm_fits(x, w, 128):
        pytest.skip("no cuBLASLt block scaling on this GPU")
    got = triton_impl.fp8_linear_scaled_mm(x, w, s, 128)
    same_numerics = triton_impl.fp8_linear_w8a8(x, w, s, 128)
    want = fp8_linear_ref(x.float(), w, s)
    assert got.shape == (m, 384)
    # The same W8A8 products as the Triton GEMM, summed in another order.
    torch.testing.assert_close(got.float(), same_numerics.float(), rtol=1e-2, atol=1e-2)
    assert ((got.float() - want).norm() / want.norm()).item() < 3e-2
    assert torch.equal(triton_impl.fp8_linear(x, w, s), got), "M >= 64 takes this path"


@pytest.mark.gpu
def test_scale_rows_cublas_misreads_stay_on_triton_gpu():
    """K/128 not a multiple of 4: cuBLASLt would return wrong results, the Triton GEMM runs."""
    x, w, s = _case(64, 384, 256, torch.bfloat16)
    assert not triton_impl.scaled_mm_fits(x, w, 128)
    got = triton_impl.fp8_linear(x, w, s)
    want = fp8_linear_ref(x.float(), w, s)
    assert ((got.float() - want).norm() / want.norm()).item() < 3e-2


class _Recorder:
    """Stands in for a Triton kernel: records each launch's grid and keywords."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, kwargs))


@pytest.mark.parametrize("rows", [2, 40, 70])
def test_fp32_activations_take_their_own_tile(rows, monkeypatch):
    """fp32 rows run in `wdq_fp32_tile` (16 rows, one stage: pipelined fp32 tiles spill and
    overflow sm_89 / sm_120's shared memory); 16-bit rows keep the row-count rule."""
    recorder = _Recorder()
    monkeypatch.setattr(triton_impl, "fp8_wdq_gemm_kernel", recorder)
    x, w, s = _case(rows, 130, 256, torch.float32)
    triton_impl.fp8_linear_weight_only(x, w, s, 128)
    triton_impl.fp8_linear_weight_only(x.bfloat16(), w, s, 128)
    (grid32, fp32), (_, bf16) = recorder.launches
    assert (fp32["BM"], fp32["num_stages"]) == triton_impl.DEFAULT_CONFIG.wdq_fp32_tile
    assert grid32[0] == -(-rows // 16)
    assert bf16["BM"] == (16 if rows <= 16 else 32 if rows <= 32 else 64)
