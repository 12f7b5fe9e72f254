"""Triton block-FP8 linear: `y = x W^T`, W in e4m3 with one fp32 scale per 128x128 block.

Four paths, picked by the number of rows (README.md has the measurements):
- one row (decode at batch 1): the weight is dequantised in registers and multiplied by FMA in
  fp32, split over K so that enough programs stream the weight (fp32 activations, and GPUs
  without FP8 products, take this weight-only kernel at every size, with bf16 products);
- a few rows (2..`codes_max_rows`, 16-bit x): the same split weight-only kernel, its products
  on tensor cores with the e4m3 codes as fp16 and each K block's product scaled once;
- up to 63 rows: activations are quantised per row and 128-channel group (DeepSeek / HF style)
  inside the weight-streaming FP8 x FP8 kernel of triton_stream.py;
- many rows (prefill): the same quantisation by a small kernel, then an FP8 x FP8 GEMM that
  applies both scales per K block: cuBLASLt's block-scaled `torch._scaled_mm` on SM90, this
  file's Triton GEMM elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import (
    has_fp8_products,
    plan_splits,
    quantize_rows,
    split_buffer,
    store_split,
)
from glmflash.kernels.fp8_gemm.triton_stream import (
    H200_CODES_RULE,
    H200_ONE_ROW_RULE,
    H200_STREAM_RULE,
    STREAM_CONFIG,
    StreamConfig,
    StreamRule,
    fp8_linear_stream,
)
from glmflash.kernels.swiglu.triton_impl import clamped_swiglu_stacked, swiglu_values
from glmflash.kernels.triton_utils import grouped_tile, interpreting, jit


@dataclass(frozen=True)
class Fp8LinearConfig:
    """Which path takes how many rows, and their launch shapes (README.md has the sweeps that
    chose them)."""

    act_min_rows: int = 2
    """Rows from which 16-bit activations leave the one-row kernel: the fp16-codes rows up to
    `codes_max_rows`, then activations quantised to FP8 (W8A8)."""
    gemm_min_rows: int = 64
    """Rows from which the tiled FP8 GEMM runs (below: the weight-streaming W8A8 form)."""
    stream: StreamConfig = STREAM_CONFIG
    """Launch shape of the weight-streaming W8A8 form where `stream_rule` does not apply."""
    stream_rule: StreamRule | None = H200_STREAM_RULE
    """Per-weight-shape launch shapes of the streaming form, on the rule's GPU (None: `stream`
    everywhere)."""
    wdq_block_n: int = 64
    """Weight-only: output columns per program."""
    wdq_fma_rows: int = 1
    """Weight-only: rows up to which products are FMAs instead of tensor-core products (0:
    never); one row needs no product and skips the dequantised tile's layout change."""
    wdq_fma_block_n: int = 32
    swiglu_fold_max_rows: int = 1
    swiglu_fold_max_k: int = 4096
    """With `swiglu_limit`, the weight-only kernel forms the SwiGLU as it reads x up to these
    rows (at most `codes_max_rows`) and this K (the shared expert's 2048); other products
    launch the SwiGLU first (README.md: from 2 rows, and at one row of the dense MLP's K
    12288, the fold is slower)."""
    codes_max_rows: int = 32
    """16-bit activations of `act_min_rows` up to this many rows take the weight-only kernel
    on fp16 codes (`_codes_range`: exact weights, x rounded to fp16, so |x| < 65504) instead of
    the W8A8 streaming form (0: never)."""
    codes_rule: StreamRule | None = H200_CODES_RULE
    """Per-weight-shape launch shapes of the fp16-codes rows on the rule's GPU (columns, waves,
    split blocks, warps, stages; None: the `wdq_*` fields everywhere)."""
    one_row_rule: StreamRule | None = H200_ONE_ROW_RULE
    """Per-weight-shape launch shapes of the one-row FMA kernel on the rule's GPU (its
    columns, waves, split blocks, warps and stages; None: the `wdq_*` fields everywhere)."""
    wdq_waves: float = 4.0
    """Weight-only: K is split until about this many programs per SM stream the weight."""
    wdq_min_split_blocks: int = 2
    """Weight-only: scale blocks per K range at least."""
    wdq_stages: int = 4
    wdq_warps: int = 4
    wdq_fp32_tile: tuple[int, int] = (16, 1)
    """Weight-only on fp32 activations (fp32 models: the tiny models' GPU tests), products on
    fp32 operands: rows a program and stages. Pipelined fp32 tiles spill and, from 32 rows,
    need more than the 99 KB of shared memory of sm_89 / sm_120 (tools/smem_check.py)."""
    w8a8_tile: tuple[int, int, int, int] = (64, 128, 4, 4)
    """W8A8 GEMM: rows, columns, warps, stages."""


DEFAULT_CONFIG = Fp8LinearConfig()


@jit
def _x_values(p_x, mask, K, limit, SWIGLU: tl.constexpr):
    """x at `p_x` in its dtype; with SWIGLU x is the stacked [gate | up] product (K columns
    each) and the values are its clamped SwiGLU, as the SwiGLU kernel rounds it."""
    if SWIGLU:
        return swiglu_values(tl.load(p_x, mask=mask, other=0.0),
                             tl.load(p_x + K, mask=mask, other=0.0), limit)
    return tl.load(p_x, mask=mask, other=0.0)


@jit
def _dot_range(x, w, ws_row, o_m, o_n, m_m, m_n, k_begin, k_end, K, stride_xm, stride_wn,
               limit, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               DOT: tl.constexpr, PREC: tl.constexpr, SWIGLU: tl.constexpr):
    """x[rows, range] W_dequant[cols, range]^T, the weight rounded to DOT as the reference does."""
    o_k = tl.arange(0, BLOCK)
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK):
        m_k = k0 + o_k < K
        b_x = _x_values(x + o_m[:, None].to(tl.int64) * stride_xm + k0 + o_k[None, :],
                        m_m[:, None] & m_k[None, :], K, limit, SWIGLU)
        b_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k0 + o_k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_s = tl.load(ws_row + k0 // BLOCK)
        b_wd = (b_w.to(tl.float32) * b_s).to(DOT)  # [BN, BLOCK], the reference's rounding
        b_acc = tl.dot(b_x.to(DOT), tl.trans(b_wd), b_acc, input_precision=PREC)
    return b_acc


@jit
def _codes_range(x, w, ws_row, o_m, o_n, m_m, m_n, k_begin, k_end, K, stride_xm, stride_wn,
                 limit, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 SWIGLU: tl.constexpr):
    """x[rows, range] W[cols, range]^T with the e4m3 codes in the product as fp16 (exact)
    against x rounded to fp16, each K block's fp32 product times its weight scale: no weight is
    dequantised in registers. The scale of the next block is loaded a step ahead, so that the
    step's last multiply does not wait on it."""
    o_k = tl.arange(0, BLOCK)
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    b_s = tl.load(ws_row + k_begin // BLOCK, mask=k_begin < k_end, other=0.0)
    for k0 in range(k_begin, k_end, BLOCK):
        b_s_next = tl.load(ws_row + k0 // BLOCK + 1, mask=k0 + BLOCK < k_end, other=0.0)
        m_k = k0 + o_k < K
        b_x = _x_values(x + o_m[:, None].to(tl.int64) * stride_xm + k0 + o_k[None, :],
                        m_m[:, None] & m_k[None, :], K, limit, SWIGLU)
        b_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k0 + o_k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_acc += tl.dot(b_x.to(tl.float16), tl.trans(b_w.to(tl.float16))) * b_s
        b_s = b_s_next
    return b_acc


@jit
def _fma_range(x, w, ws_row, o_n, m_n, k_begin, k_end, K, stride_wn, limit,
               BLOCK: tl.constexpr, BN: tl.constexpr, SWIGLU: tl.constexpr):
    """One row of x against W[cols, range] by FMA: each weight times x * scale in fp32 (no
    rounding of the weight to bf16), summed in a [BN, BLOCK] tile reduced once at the end."""
    o_k = tl.arange(0, BLOCK)
    p_w = w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    b_acc = tl.zeros([BN, BLOCK], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK):
        b_w = tl.load(p_w + k0, mask=m_n[:, None] & (k0 + o_k < k_end)[None, :], other=0.0)
        b_x = _x_values(x + k0 + o_k, k0 + o_k < K, K, limit, SWIGLU).to(tl.float32)
        b_s = tl.load(ws_row + k0 // BLOCK)
        b_acc += b_w.to(tl.float32) * (b_x * b_s)[None, :]
    return tl.sum(b_acc, 1)[None, :]


@jit
def fp8_wdq_gemm_kernel(x, w, ws, y, part, arrivals, M, N, K, stride_xm, stride_wn, stride_wsn,
                        stride_ym, K_PER_SPLIT, SPLITS, limit, BLOCK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, DOT: tl.constexpr,
                        PREC: tl.constexpr, FMA: tl.constexpr, CODES: tl.constexpr,
                        SWIGLU: tl.constexpr):
    """y = x W_dequant^T over one K range per program; W dequantised block by block in
    registers (FMA: one row, BM = 1, no products; CODES: not dequantised, `_codes_range`). With
    SPLITS > 1 each range's fp32 sum goes to `part` and the range that arrives last at
    `arrivals[tile]` writes y from all of them. SWIGLU: x is a stacked [gate | up] product and
    the product's input its clamped SwiGLU (`_x_values`)."""
    i_m, i_n, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    m_m, m_n = o_m < M, o_n < N
    # NOTE: BN divides BLOCK, so one weight scale row per program.
    ws_row = ws + ((i_n * BN) // BLOCK) * stride_wsn
    k_begin = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if FMA:
        b_acc = _fma_range(x + i_m.to(tl.int64) * stride_xm, w, ws_row, o_n, m_n, k_begin, k_end,
                           K, stride_wn, limit, BLOCK, BN, SWIGLU)
    elif CODES:
        b_acc = _codes_range(x, w, ws_row, o_m, o_n, m_m, m_n, k_begin, k_end, K, stride_xm,
                             stride_wn, limit, BLOCK, BM, BN, SWIGLU)
    else:
        b_acc = _dot_range(x, w, ws_row, o_m, o_n, m_m, m_n, k_begin, k_end, K, stride_xm,
                           stride_wn, limit, BLOCK, BM, BN, DOT, PREC, SWIGLU)
    o_y = o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    store_split(b_acc, y, o_y, m_m[:, None] & m_n[None, :], part, arrivals,
                i_m * tl.num_programs(1) + i_n, i_s, SPLITS, BM, BN)


@jit
def fp8_act_quant_kernel(x, xq, xs, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                         BLOCK: tl.constexpr, BM: tl.constexpr):
    """Per row and 128-channel group: scale = amax / 448, xq = x / scale in e4m3."""
    i_m, i_k = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_k = i_k * BLOCK + tl.arange(0, BLOCK)
    m = (o_m < M)[:, None] & (o_k < K)[None, :]
    b_x = tl.load(x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :], mask=m,
                  other=0.0).to(tl.float32)
    b_q, b_s = quantize_rows(b_x, xq.dtype.element_ty)  # [BM, BLOCK], [BM]
    tl.store(xq + o_m[:, None].to(tl.int64) * stride_qm + o_k[None, :], b_q, mask=m)
    tl.store(xs + o_m.to(tl.int64) * stride_sm + i_k * stride_sk, b_s, mask=o_m < M)


@jit
def fp8_gemm_kernel(xq, xs, w, ws, y, M, N, K, stride_qm, stride_sm, stride_wn, stride_wsn,
                    stride_ym, BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    GROUP_M: tl.constexpr):
    """y = sum_kb (xq_kb W_kb^T) * xs[:, kb] * ws[n // BLOCK, kb], FP8 products, fp32
    accumulation."""
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    i_m, i_n = grouped_tile(pid, num_m, num_n, GROUP_M)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BLOCK)
    m_m, m_n = o_m < M, o_n < N
    p_ws = ws + (o_n // BLOCK) * stride_wsn
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        m_k = k0 + o_k < K
        b_x = tl.load(xq + o_m[:, None].to(tl.int64) * stride_qm + k0 + o_k[None, :],
                      mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w + o_n[:, None].to(tl.int64) * stride_wn + k0 + o_k[None, :],
                      mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_xs = tl.load(xs + o_m.to(tl.int64) * stride_sm + k0 // BLOCK, mask=m_m, other=0.0)
        b_ws = tl.load(p_ws + k0 // BLOCK, mask=m_n, other=0.0)
        b_acc += tl.dot(b_x, tl.trans(b_w)) * (b_xs[:, None] * b_ws[None, :])
    p_y = y + o_m[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def _check(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int) -> None:
    n, k = weight.shape
    assert x.shape[-1] == k and weight.stride(1) == 1 and scale_inv.stride(1) == 1
    assert scale_inv.shape == (-(-n // block), -(-k // block)), (
        f"scale shape {tuple(scale_inv.shape)} does not fit weight {tuple(weight.shape)}")
    assert block >= 16 and block & (block - 1) == 0


def fp8_linear_weight_only(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                           block: int, config: Fp8LinearConfig = DEFAULT_CONFIG,
                           swiglu_limit: float | None = None) -> torch.Tensor:
    """[M, K] x dequantised [N, K] -> [M, N], K split into ranges so that enough programs stream
    the weight. With `swiglu_limit` x2 is `[M, 2K]`, a stacked [gate | up] product: its
    clamped SwiGLU is formed as it is read up to `config.swiglu_fold_max_rows` and
    `swiglu_fold_max_k`, launched first otherwise. Launches on one device must run in
    stream order (they share the counters)."""
    m = x2.shape[0]
    n, k = weight.shape
    assert x2.shape[1] == (k if swiglu_limit is None else 2 * k), (tuple(x2.shape), k)
    fma = m <= config.wdq_fma_rows
    if swiglu_limit is not None and not (m <= config.swiglu_fold_max_rows
                                         and k <= config.swiglu_fold_max_k):
        x2, swiglu_limit = clamped_swiglu_stacked(x2, swiglu_limit), None
    fp32 = x2.dtype == torch.float32 or interpreting()
    dot = tl.float32 if fp32 else (tl.float16 if x2.dtype == torch.float16 else tl.bfloat16)
    codes = not fma and x2.dtype != torch.float32 and m <= config.codes_max_rows
    bm = 1 if fma else (16 if m <= 16 else (32 if m <= 32 else 64))
    shape = _weight_only_shape(config, fma, weight.shape, x2.device, codes)
    if x2.dtype == torch.float32 and not fma:
        bm, stages = config.wdq_fp32_tile
        shape = dataclasses.replace(shape, num_stages=stages)
    bn = min(shape.block_n, block)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits, k_per_split, arrivals = plan_splits(x2.device, tiles, k, block, shape.waves,
                                                shape.min_split_blocks)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    part = split_buffer(splits, tiles, bm * bn, out)
    fp8_wdq_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
        x2, weight, scale_inv, out, part, arrivals if splits > 1 else out, m, n, k, x2.stride(0),
        weight.stride(0), scale_inv.stride(0), out.stride(0), k_per_split, splits,
        0.0 if swiglu_limit is None else float(swiglu_limit), BLOCK=block, BM=bm, BN=bn, DOT=dot,
        PREC="ieee" if fp32 else "tf32", FMA=fma, CODES=codes, SWIGLU=swiglu_limit is not None,
        num_warps=shape.num_warps, num_stages=shape.num_stages)
    return out


def _weight_only_shape(config: Fp8LinearConfig, fma: bool, weight_shape: torch.Size,
                       device: torch.device, codes: bool = False) -> StreamConfig:
    """The weight-only launch: the one-row rule's shape for this weight on its GPU (FMA), the
    codes rule's (fp16 codes), else the `wdq_*` fields."""
    block_n = config.wdq_fma_block_n if fma else config.wdq_block_n
    fields = StreamConfig(block_n=block_n, waves=config.wdq_waves,
                          min_split_blocks=config.wdq_min_split_blocks,
                          num_warps=config.wdq_warps, num_stages=config.wdq_stages)
    rule = config.one_row_rule if fma else config.codes_rule if codes else None
    if rule is None or device.type != "cuda":
        return fields
    return rule.pick_for(*weight_shape, device, fields)


def quantize_activations(x2: torch.Tensor, fp8_dtype: torch.dtype, block: int,
                         rows: int | None = None, scales_m_major: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[M, K]` -> e4m3 `[rows, K]` and fp32 scales `[rows, ceil(K/block)]`, one per (row,
    block channels); `rows` >= M pads (rows past M are left unwritten). `scales_m_major`: the
    scales' row stride is 1 (cuBLAS's layout for block-scaled `_scaled_mm`)."""
    m, k = x2.shape
    rows = rows or m
    k_blocks = triton.cdiv(k, block)
    xq = torch.empty(rows, k, dtype=fp8_dtype, device=x2.device)
    xs = torch.empty(k_blocks, rows, dtype=torch.float32, device=x2.device).t() \
        if scales_m_major else torch.empty(rows, k_blocks, dtype=torch.float32, device=x2.device)
    fp8_act_quant_kernel[(triton.cdiv(m, 16), k_blocks)](
        x2, xq, xs, m, k, x2.stride(0), xq.stride(0), xs.stride(0), xs.stride(1), BLOCK=block,
        BM=16, num_warps=4)
    return xq, xs


def fp8_linear_w8a8(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                    block: int, config: Fp8LinearConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Quantise activations per (row, 128 channels), then the FP8 GEMM."""
    m, k = x2.shape
    n = weight.shape[0]
    xq, xs = quantize_activations(x2, weight.dtype, block)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    bm, bn, warps, stages = config.w8a8_tile
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    fp8_gemm_kernel[grid](xq, xs, weight, scale_inv, out, m, n, k, xq.stride(0), xs.stride(0),
                          weight.stride(0), scale_inv.stride(0), out.stride(0), BLOCK=block,
                          BM=bm, BN=bn, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def fp8_linear_scaled_mm(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: int) -> torch.Tensor:
    """W8A8 through cuBLASLt's block scaling (`torch._scaled_mm` with 1x128 activation scales,
    M-major, and the checkpoint's 128x128 weight scales); M padded to a multiple of 4."""
    m = x2.shape[0]
    xq, xs = quantize_activations(x2, weight.dtype, block, rows=-(-m // 4) * 4,
                                  scales_m_major=True)
    out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_inv.t(),
                           out_dtype=x2.dtype)
    return out[:m]


def scaled_mm_fits(x2: torch.Tensor, weight: torch.Tensor, block: int) -> bool:
    """Whether cuBLASLt's block-scaled FP8 GEMM serves this product: SM90 (Hopper) only - SM89
    and SM120 have no 1x128 / 128x128 block scaling in cuBLASLt, and run the Triton GEMM - and
    128-aligned weights with 128-wide blocks, K a multiple of 512.

    NOTE: the weight scales are read with a leading dimension of K/128 floats; unless that is a
    multiple of 4 (16 bytes) cuBLASLt accepts the call and returns wrong results
    (bench/scaled_mm_layouts.py).
    """
    n, k = weight.shape
    return (x2.is_cuda and block == 128 and n % 128 == 0 and k % 512 == 0
            and x2.dtype in (torch.bfloat16, torch.float16) and not interpreting()
            and torch.cuda.get_device_capability(x2.device) == (9, 0))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, *,
               block: int = 128, config: Fp8LinearConfig | None = None,
               swiglu_limit: float | None = None) -> torch.Tensor:
    """Triton `fp8_linear_ref`: `y = x W^T`, x `[..., K]`, weight `[N, K]` e4m3, scale_inv
    `[ceil(N/block), ceil(K/block)]` fp32. Weight-only below `config.act_min_rows` rows and (on
    fp16 codes) up to `config.codes_max_rows`, W8A8 beyond: weight-streaming below
    `config.gemm_min_rows`, tiled from there (`config`: DEFAULT_CONFIG, read at call time).
    With `swiglu_limit`, x `[..., 2K]` is a stacked [gate | up] product and the product is of
    its clamped SwiGLU (`clamped_swiglu_stacked`): the weight-only kernel forms it as it reads
    x within `swiglu_fold_max_rows` / `swiglu_fold_max_k`, the other shapes launch it first."""
    config = config or DEFAULT_CONFIG
    if swiglu_limit is not None:
        assert x.shape[-1] == 2 * weight.shape[1], f"x {tuple(x.shape)} is not [gate | up]"
    _check(x if swiglu_limit is None else x[..., : weight.shape[1]], weight, scale_inv, block)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0:
        return x.new_empty(*lead, weight.shape[0])
    out = _linear_2d(x2, weight, scale_inv.float(), block, config, swiglu_limit)
    return out.view(*lead, weight.shape[0])


def _linear_2d(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: int,
               config: Fp8LinearConfig, swiglu_limit: float | None = None) -> torch.Tensor:
    """The path by rows: weight-only (FMA at one row, fp16 codes up to `codes_max_rows`),
    weight-streaming W8A8, or a tiled W8A8 GEMM (cuBLASLt's where it fits); fp32 activations,
    the interpreter and GPUs without FP8 products (before SM89) stay weight-only."""
    m = x2.shape[0]
    if m < config.act_min_rows or m <= config.codes_max_rows or x2.dtype == torch.float32 \
            or interpreting() or not has_fp8_products(x2.device):
        return fp8_linear_weight_only(x2, weight, scale_inv, block, config, swiglu_limit)
    if swiglu_limit is not None:
        x2 = clamped_swiglu_stacked(x2, swiglu_limit)
    if m < config.gemm_min_rows:
        n, k = weight.shape
        rule = config.stream_rule
        stream = config.stream if rule is None else rule.pick_for(n, k, x2.device, config.stream)
        return fp8_linear_stream(x2, weight, scale_inv, block, stream)
    if scaled_mm_fits(x2, weight, block):
        return fp8_linear_scaled_mm(x2, weight, scale_inv, block)
    return fp8_linear_w8a8(x2, weight, scale_inv, block, config)


__all__ = ["DEFAULT_CONFIG", "Fp8LinearConfig", "fp8_linear", "fp8_linear_scaled_mm",
           "fp8_linear_stream", "fp8_linear_w8a8", "fp8_linear_weight_only",
           "quantize_activations", "scaled_mm_fits"]
