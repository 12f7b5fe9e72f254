"""Triton grouped MoE over stacked expert weights (block-FP8 or plain), with no host read of the
routing: every size the host uses follows from the tensor shapes.

Four launches (README.md has the layout and why it needs no sync):
1. `fused_moe_align_kernel`: the T*k (token, slot) pairs sorted by expert into groups padded to
   BLOCK_M rows, and each row block's expert (-1: an unused block);
2. `fused_moe_gate_up_kernel`: per row block, its expert's gate and up projections of its rows
   (weights dequantised in registers), clamped SwiGLU, h in x's dtype;
3. `fused_moe_down_kernel`: h W_down^T, one output row per pair, in x's dtype;
4. `fused_moe_sum_kernel` (expert_rows.py): each token's pairs times their routing weights,
   summed in slot order.
Prefill with FP8 weights on GPUs with FP8 products replaces 2 and 3 by the W8A8 form
(triton_w8a8.py: activations and h quantised to e4m3, FP8 x FP8 products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import has_fp8_products
from glmflash.kernels.fp8_gemm.triton_impl import quantize_activations
from glmflash.kernels.fused_moe.expert_rows import ExpertRows, sum_rows
from glmflash.kernels.fused_moe.gluon_w8a8 import (
    GLUON_W8A8_CONFIG,
    GluonMoeConfig,
    gluon_experts,
    gluon_fits,
)
from glmflash.kernels.fused_moe.triton_sort import SORT_CONFIG, SortConfig, sort_pairs_scan
from glmflash.kernels.fused_moe.triton_w8a8 import W8A8_CONFIG, W8A8MoeConfig, w8a8_experts
from glmflash.kernels.swiglu.triton_impl import clamp_gate_up
from glmflash.kernels.triton_utils import dot_operand_type, interpreting, jit, product_precision


@dataclass(frozen=True)
class FusedMoeConfig:
    """Launch shape of the two grouped GEMMs."""

    block_m: int = 16
    """Rows per block; each expert's pairs are padded to a multiple of it."""
    block_n: int = 64
    """Output columns per program."""
    block_k: int = 128
    """Reduction step; with FP8 weights it must divide the scale block."""
    num_warps: int = 4
    num_stages: int = 3
    fp16_codes: bool = False
    """FP8 weights with 16-bit x: the e4m3 codes enter the products as fp16 (exact) against x
    rounded to fp16, and each K step's product is scaled by its block scales in fp32, so no
    weight is dequantised in registers (the reference rounds `code * scale` to bf16 instead;
    this is closer to the exact product). x must lie within fp16's range. block_k must equal
    the scale block."""


# Decode: few pairs per expert, so 16-row blocks (the smallest tensor-core product) waste least;
# the weights enter as fp16 codes (README.md, "The fp16-codes decode form"). Every shape fits the
# shared memory of sm_89 / sm_120 (tools/smem_check.py).
DECODE_CONFIG = FusedMoeConfig(block_n=128, fp16_codes=True)
PREFILL_CONFIG = FusedMoeConfig(block_m=64, block_k=64)
# fp32 operands (the tiny models' tests): FMA products, small tiles keep them out of spills.
FP32_CONFIG = FusedMoeConfig(block_n=32, block_k=32, num_stages=2)
# Pairs per step of the alignment scan.
ALIGN_BLOCK = 256


@dataclass(frozen=True)
class MoeDispatchConfig:
    """Which form and launch shape a call without a `config` takes."""

    prefill_pairs_per_expert: int = 16
    """Pairs per expert (on average) from which the prefill forms are used."""
    fp8_activations: bool = True
    """Prefill with FP8 weights runs W8A8 on FP8 tensor cores (SM89 and later, 16-bit x);
    False: the dequantising bf16 form everywhere."""
    w8a8: W8A8MoeConfig = W8A8_CONFIG
    gluon: GluonMoeConfig | None = GLUON_W8A8_CONFIG
    """The W8A8 form on SM90 where the Gluon kernel takes the shapes (gluon_w8a8.py; None:
    the Triton W8A8 kernels there too)."""
    sort: SortConfig = SORT_CONFIG
    """The sort: one launch for few pairs, histogram + scatter (triton_sort.py) from
    `sort.scan_min_pairs`."""


DEFAULT_DISPATCH = MoeDispatchConfig()


def default_config(num_pairs: int, num_experts: int, x: torch.Tensor, has_scale: bool,
                   block: int, dispatch: MoeDispatchConfig | None = None, *,
                   inter: int | None = None) -> FusedMoeConfig | W8A8MoeConfig | GluonMoeConfig:
    """The launch shape by x's dtype and pairs per expert; W8A8 for FP8 prefill where the GPU
    multiplies e4m3, on the Gluon kernel where it takes experts of x's width by `inter` (not
    considered without `inter`) (`dispatch`: DEFAULT_DISPATCH, read at call time)."""
    dispatch = dispatch or DEFAULT_DISPATCH
    if x.dtype == torch.float32:
        return FP32_CONFIG
    if num_pairs < dispatch.prefill_pairs_per_expert * num_experts:
        return DECODE_CONFIG
    if (dispatch.fp8_activations and has_scale and block >= 32 and not interpreting()
            and has_fp8_products(x.device)):
        if (dispatch.gluon is not None and inter is not None
                and gluon_fits(x, x.shape[-1], inter, block)):
            return dispatch.gluon
        return dispatch.w8a8
    return PREFILL_CONFIG



@jit
def fused_moe_align_kernel(ids, sorted_pairs, block_expert, num_pairs, num_experts, max_blocks,
                           BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BINS: tl.constexpr):
    """Program e counts every expert's pairs, then writes expert e's group: its pairs in pair
    order, padding rows (`num_pairs`) up to a multiple of BLOCK_M, and its blocks' expert id.
    Program 0 also marks the blocks past the last group unused (-1)."""
    e = tl.program_id(0)
    o_p = tl.arange(0, BLOCK)
    o_e = tl.arange(0, BINS)
    # Ids outside [0, num_experts) (skipped pairs, and the masked tail) count in bin num_experts.
    b_hist = tl.zeros([BINS], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        b_id = tl.load(ids + p0 + o_p, mask=p0 + o_p < num_pairs, other=-1)
        b_bin = tl.where((b_id >= 0) & (b_id < num_experts), b_id, num_experts)
        b_hist += tl.histogram(b_bin.to(tl.int32), BINS)
    b_count = tl.where(o_e < num_experts, b_hist, 0)  # [BINS]
    b_padded = (b_count + BLOCK_M - 1) // BLOCK_M * BLOCK_M  # [BINS]
    start = tl.sum(tl.where(o_e < e, b_padded, 0), 0)
    count = tl.sum(tl.where(o_e == e, b_count, 0), 0)
    num_blocks = tl.sum(tl.where(o_e == e, b_padded, 0), 0) // BLOCK_M
    b_seen = tl.zeros([BLOCK], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        b_id = tl.load(ids + p0 + o_p, mask=p0 + o_p < num_pairs, other=-1)
        m_hit = b_id == e
        b_rank = b_seen + tl.cumsum(m_hit.to(tl.int32), 0) - 1  # [BLOCK]
        tl.store(sorted_pairs + start + b_rank, p0 + o_p, mask=m_hit)
        b_seen += tl.sum(m_hit.to(tl.int32), 0)
    o_m = tl.arange(0, BLOCK_M)
    tl.store(sorted_pairs + start + count + o_m, tl.zeros([BLOCK_M], dtype=tl.int32) + num_pairs,
             mask=count + o_m < num_blocks * BLOCK_M)
    b_e = tl.zeros([BLOCK], dtype=tl.int32) + e
    for b0 in range(0, num_blocks, BLOCK):
        tl.store(block_expert + start // BLOCK_M + b0 + o_p, b_e, mask=b0 + o_p < num_blocks)
    if e == 0:
        b_unused = tl.zeros([BLOCK], dtype=tl.int32) - 1
        for b0 in range(tl.sum(b_padded, 0) // BLOCK_M, max_blocks, BLOCK):
            tl.store(block_expert + b0 + o_p, b_unused, mask=b0 + o_p < max_blocks)


@jit
def _block_rows(sorted_pairs, i_b, num_pairs, BM: tl.constexpr):
    """Row offsets of block i_b, their pairs, and which rows hold a pair."""
    o_r = i_b * BM + tl.arange(0, BM)
    b_pair = tl.load(sorted_pairs + o_r)
    return o_r, b_pair, b_pair < num_pairs


@jit
def _dequant(b_w, s, s_off, k0, m_n, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr,
             DOT: tl.constexpr):
    """A [BN, BK] weight tile in DOT: fp8 * its block scale in fp32, then one rounding."""
    if HAS_SCALE:
        b_s = tl.load(s + s_off + k0 // BLOCK, mask=m_n, other=0.0)  # [BN]
        return (b_w.to(tl.float32) * b_s[:, None]).to(DOT)
    return b_w.to(DOT)


@jit
def _next_scale(s, s_off, k0, K, m_n, BK: tl.constexpr, BLOCK: tl.constexpr):
    """The block scales [BN] of the K step after k0 (zeros past K): loaded a step ahead, so
    that their latency passes under this step's products."""
    # NOTE: the scalar condition is broadcast by hand (the interpreter rejects scalar & tensor).
    m_next = m_n & ((m_n.to(tl.int32) * 0 + k0 + BK) < K)
    return tl.load(s + s_off + (k0 + BK) // BLOCK, mask=m_next, other=0.0)


@jit
def _codes_product(b_acc, b_x, b_w, b_s):
    """b_acc + (x W^T) * s over one K step: the e4m3 codes and x in fp16 (the codes exactly),
    the fp32 product scaled per column by its block scale."""
    return b_acc + tl.dot(b_x.to(tl.float16), tl.trans(b_w.to(tl.float16))) * b_s[None, :]


@jit
def _gate_up_codes(p_x, w_gate, s_gate, w_up, s_up, w_off, s_off, m_r, m_n, o_k, K,
                   BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Both products of a block by fp16 codes (`FusedMoeConfig.fp16_codes`)."""
    b_gate = tl.zeros([BM, BN], dtype=tl.float32)
    b_up = tl.zeros([BM, BN], dtype=tl.float32)
    b_sg = _next_scale(s_gate, s_off, -BK, K, m_n, BK, BLOCK)
    b_su = _next_scale(s_up, s_off, -BK, K, m_n, BK, BLOCK)
    for k0 in range(0, K, BK):
        b_sg_next = _next_scale(s_gate, s_off, k0, K, m_n, BK, BLOCK)
        b_su_next = _next_scale(s_up, s_off, k0, K, m_n, BK, BLOCK)
        m_k = k0 + o_k < K
        m_w = m_n[:, None] & m_k[None, :]
        b_x = tl.load(p_x + k0, mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_gate = _codes_product(b_gate, b_x, tl.load(w_gate + w_off + k0, mask=m_w, other=0.0),
                                b_sg)
        b_up = _codes_product(b_up, b_x, tl.load(w_up + w_off + k0, mask=m_w, other=0.0), b_su)
        b_sg, b_su = b_sg_next, b_su_next
    return b_gate, b_up


@jit
def _down_codes(p_h, w, s, w_off, s_off, m_r, m_n, o_k, K, BLOCK: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The down product of a block by fp16 codes (`FusedMoeConfig.fp16_codes`)."""
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    b_s = _next_scale(s, s_off, -BK, K, m_n, BK, BLOCK)
    for k0 in range(0, K, BK):
        b_s_next = _next_scale(s, s_off, k0, K, m_n, BK, BLOCK)
        m_k = k0 + o_k < K
        b_h = tl.load(p_h + k0, mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(w + w_off + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
        b_acc = _codes_product(b_acc, b_h, b_w, b_s)
        b_s = b_s_next
    return b_acc


@jit
def fused_moe_gate_up_kernel(x, sorted_pairs, block_expert, w_gate, s_gate, w_up, s_up, h,
                             num_pairs, N, K, limit, stride_xm, stride_we, stride_wn, stride_se,
                             stride_sn, stride_hm, TOP_K: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_SCALE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                             CODES: tl.constexpr):
    """h[rows, cols] = silu(min(x Wg^T, L)) * clip(x Wu^T, -L, L) for the rows of one block,
    all of one expert; a block without an expert returns before reading any weight."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r, b_pair, m_r = _block_rows(sorted_pairs, i_b, num_pairs, BM)
    o_t = tl.where(m_r, b_pair // TOP_K, 0)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    p_x = x + o_t[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    w_off = e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    s_off = e.to(tl.int64) * stride_se + (o_n // BLOCK) * stride_sn
    if CODES:
        b_gate, b_up = _gate_up_codes(p_x, w_gate, s_gate, w_up, s_up, w_off, s_off, m_r, m_n,
                                      o_k, K, BLOCK, BM, BN, BK)
    else:
        b_gate = tl.zeros([BM, BN], dtype=tl.float32)
        b_up = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            m_k = k0 + o_k < K
            m_w = m_n[:, None] & m_k[None, :]
            b_x = tl.load(p_x + k0, mask=m_r[:, None] & m_k[None, :], other=0.0).to(DOT)
            b_wg = _dequant(tl.load(w_gate + w_off + k0, mask=m_w, other=0.0), s_gate, s_off,
                            k0, m_n, BLOCK, HAS_SCALE, DOT)
            b_wu = _dequant(tl.load(w_up + w_off + k0, mask=m_w, other=0.0), s_up, s_off, k0,
                            m_n, BLOCK, HAS_SCALE, DOT)
            b_gate = tl.dot(b_x, tl.trans(b_wg), b_gate, input_precision=PREC)
            b_up = tl.dot(b_x, tl.trans(b_wu), b_up, input_precision=PREC)
    b_gate, b_up = clamp_gate_up(b_gate, b_up, limit)
    b_h = b_gate * tl.sigmoid(b_gate) * b_up  # [BM, BN]
    p_h = h + o_r[:, None].to(tl.int64) * stride_hm + o_n[None, :]
    tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


@jit
def fused_moe_down_kernel(h, sorted_pairs, block_expert, w, s, y, num_pairs, N, K, stride_hm,
                          stride_we, stride_wn, stride_se, stride_sn, stride_ym,
                          BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr, BM: tl.constexpr,
                          BN: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                          PREC: tl.constexpr, CODES: tl.constexpr):
    """y[pair, cols] = h[row] W_down^T for the rows of one block, each row into its pair's
    row of y; a block without an expert returns before reading any weight."""
    i_b, i_n = tl.program_id(0), tl.program_id(1)
    e = tl.load(block_expert + i_b)
    if e < 0:
        return
    o_r, b_pair, m_r = _block_rows(sorted_pairs, i_b, num_pairs, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_n = o_n < N
    p_h = h + o_r[:, None].to(tl.int64) * stride_hm + o_k[None, :]
    w_off = e.to(tl.int64) * stride_we + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    s_off = e.to(tl.int64) * stride_se + (o_n // BLOCK) * stride_sn
    if CODES:
        b_acc = _down_codes(p_h, w, s, w_off, s_off, m_r, m_n, o_k, K, BLOCK, BM, BN, BK)
    else:
        b_acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            m_k = k0 + o_k < K
            b_h = tl.load(p_h + k0, mask=m_r[:, None] & m_k[None, :], other=0.0).to(DOT)
            b_w = _dequant(tl.load(w + w_off + k0, mask=m_n[:, None] & m_k[None, :],
                                   other=0.0), s, s_off, k0, m_n, BLOCK, HAS_SCALE, DOT)
            b_acc = tl.dot(b_h, tl.trans(b_w), b_acc, input_precision=PREC)
    p_y = y + tl.where(m_r, b_pair, 0)[:, None].to(tl.int64) * stride_ym + o_n[None, :]
    tl.store(p_y, b_acc.to(y.dtype.element_ty), mask=m_r[:, None] & m_n[None, :])


def _check(x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down, block: int) -> None:
    num_experts, inter, hidden = w_gate.shape
    assert x.ndim == 2 and x.shape[1] == hidden, f"x {tuple(x.shape)} vs hidden {hidden}"
    assert ids.ndim == 2 and ids.shape == weights.shape and ids.shape[0] == x.shape[0]
    assert not ids.is_floating_point(), "ids must be integers"
    assert w_up.shape == w_gate.shape and w_up.stride() == w_gate.stride()
    assert w_down.shape == (num_experts, hidden, inter)
    assert w_gate.stride(2) == 1 and w_down.stride(2) == 1
    scales = (s_gate, s_up, s_down)
    assert all(s is None for s in scales) or all(s is not None for s in scales)
    if s_gate is not None:
        want = (num_experts, -(-inter // block), -(-hidden // block))
        assert s_gate.shape == want and s_up.shape == want and s_up.stride() == s_gate.stride()
        assert s_down.shape == (num_experts, want[2], want[1])
        assert block >= 16 and block & (block - 1) == 0


def _dot_type(x: torch.Tensor) -> tuple[object, str]:
    """Operand type and precision of the products: fp32 (exact products) for fp32 x and in the
    interpreter, else x's 16-bit type."""
    return dot_operand_type(x.dtype), product_precision(x.dtype)


def _weight_args(w: torch.Tensor, s: torch.Tensor | None) -> tuple:
    """The scale pointer (the weight when unscaled, never read) and the strides (the scales
    fp32 and contiguous: `_expert_rows`)."""
    if s is None:
        return (w, w.stride(0), w.stride(1), 0, 0)
    return (s, w.stride(0), w.stride(1), s.stride(0), s.stride(1))


def sort_pairs(ids: torch.Tensor, num_experts: int, block_m: int,
               config: SortConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted block layout of contiguous `ids` `[T, k]`: (pair of each row, int32
    `[blocks * block_m]`; expert of each block, int32 `[blocks]`, -1 for an unused block).
    `config`: which sort (default: DEFAULT_DISPATCH.sort, read at call time)."""
    config = config or DEFAULT_DISPATCH.sort
    num_pairs = ids.numel()
    # NOTE: each expert hit pads at most block_m - 1 rows and at most min(E, pairs) experts are
    # hit: a bound from the shapes alone, so the host never reads the counts.
    max_blocks = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)
    if num_pairs >= config.scan_min_pairs:
        return sort_pairs_scan(ids, num_experts, block_m, max_blocks, config)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    fused_moe_align_kernel[(num_experts,)](
        ids, sorted_pairs, block_expert, num_pairs, num_experts, max_blocks, BLOCK_M=block_m,
        BLOCK=ALIGN_BLOCK, BINS=triton.next_power_of_2(num_experts + 1), num_warps=4)
    return sorted_pairs, block_expert


def _dequant_experts(x: torch.Tensor, sorted_pairs: torch.Tensor, block_expert: torch.Tensor,
                     top_k: int, w_gate: torch.Tensor, s_gate: torch.Tensor | None,
                     w_up: torch.Tensor, s_up: torch.Tensor | None, w_down: torch.Tensor,
                     s_down: torch.Tensor | None, *, limit: float, block: int,
                     config: FusedMoeConfig) -> torch.Tensor:
    """Both grouped GEMMs with the weights dequantised in registers: each pair's expert output
    `[T * top_k, D]` in x's dtype (rows of skipped pairs unwritten)."""
    num_tokens, hidden = x.shape
    inter = w_gate.shape[1]
    num_pairs = num_tokens * top_k
    bm = config.block_m
    max_blocks = block_expert.numel()
    has_scale = s_gate is not None
    bk = min(config.block_k, block) if has_scale else config.block_k
    dot, prec = _dot_type(x)
    codes = config.fp16_codes and has_scale and x.dtype != torch.float32
    # K steps within one scale block each (bk and block are powers of two, bk <= block).
    assert block % bk == 0, f"K step {bk} must divide the scale block {block}"
    shape = dict(BLOCK=block, HAS_SCALE=has_scale, BM=bm, BN=config.block_n, BK=bk, DOT=dot,
                 PREC=prec, CODES=codes, num_warps=config.num_warps,
                 num_stages=config.num_stages)
    h = torch.empty(max_blocks * bm, inter, dtype=x.dtype, device=x.device)
    gate_args = _weight_args(w_gate, s_gate)
    fused_moe_gate_up_kernel[(max_blocks, triton.cdiv(inter, config.block_n))](
        x, sorted_pairs, block_expert, w_gate, gate_args[0], w_up, _weight_args(w_up, s_up)[0],
        h, num_pairs, inter, hidden, float(limit), x.stride(0), *gate_args[1:], h.stride(0),
        TOP_K=top_k, **shape)
    y = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down_args = _weight_args(w_down, s_down)
    fused_moe_down_kernel[(max_blocks, triton.cdiv(hidden, config.block_n))](
        h, sorted_pairs, block_expert, w_down, down_args[0], y, num_pairs, hidden, inter,
        h.stride(0), *down_args[1:], y.stride(0), **shape)
    return y


def fused_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate: torch.Tensor,
              s_gate: torch.Tensor | None, w_up: torch.Tensor, s_up: torch.Tensor | None,
              w_down: torch.Tensor, s_down: torch.Tensor | None, *, limit: float,
              block: int = 128,
              config: FusedMoeConfig | W8A8MoeConfig | GluonMoeConfig | None = None,
              sort: SortConfig | None = None, rows: bool = False
              ) -> torch.Tensor | ExpertRows:
    """Triton `fused_moe_ref`; see ref.py for shapes. `config`: the form and launch shape
    (default: `default_config`); a `W8A8MoeConfig` takes the FP8-activation form, a
    `GluonMoeConfig` the same form on the Gluon GEMM (SM90). `sort`: the
    sort's choice (default: DEFAULT_DISPATCH.sort). `rows`: return the pairs' rows before
    their sum (`ExpertRows`, for a consumer that sums them as it reads)."""
    _check(x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down, block)
    num_tokens, hidden = x.shape
    num_experts = w_gate.shape[0]
    top_k = ids.shape[1]
    ids, weights = ids.contiguous(), weights.contiguous()
    if num_tokens == 0 or top_k == 0:
        y = x.new_empty(0, hidden)
    else:
        y = _expert_rows(x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down,
                         limit=limit, block=block, config=config, sort=sort)
    expert_rows = ExpertRows(y, ids, weights, num_experts)
    return expert_rows if rows else sum_rows(expert_rows)


def _expert_rows(x, ids, weights, w_gate, s_gate, w_up, s_up, w_down, s_down, *, limit, block,
                 config, sort) -> torch.Tensor:
    """Each pair's expert output `[T * k, D]` (rows of skipped pairs unwritten)."""
    num_experts, top_k = w_gate.shape[0], ids.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    # Every form steps along a row of scales (the K blocks) by 1: another layout is copied.
    s_gate, s_up, s_down = (s if s is None else s.float().contiguous()
                            for s in (s_gate, s_up, s_down))
    cfg = config or default_config(ids.numel(), num_experts, x, s_gate is not None, block,
                                   inter=w_gate.shape[1])
    sorted_pairs, block_expert = sort_pairs(ids, num_experts, cfg.block_m, sort)
    if isinstance(cfg, (W8A8MoeConfig, GluonMoeConfig)):
        assert s_gate is not None, "the W8A8 form needs FP8 weights"
        xq, xs = quantize_activations(x, w_gate.dtype, block)
        weights_fp8 = (w_gate, s_gate, w_up, s_up, w_down, s_down)
        if isinstance(cfg, GluonMoeConfig):
            y = gluon_experts(xq, xs, sorted_pairs, block_expert, top_k, *weights_fp8,
                              limit=limit, out_dtype=x.dtype, config=cfg)
        else:
            y = w8a8_experts(xq, xs, sorted_pairs, block_expert, top_k, *weights_fp8,
                             limit=limit, block=block, out_dtype=x.dtype, config=cfg)
    else:
        y = _dequant_experts(x, sorted_pairs, block_expert, top_k, w_gate, s_gate, w_up, s_up,
                             w_down, s_down, limit=limit, block=block, config=cfg)
    return y


__all__ = ["DECODE_CONFIG", "DEFAULT_DISPATCH", "FP32_CONFIG", "PREFILL_CONFIG", "ExpertRows",
           "FusedMoeConfig", "GluonMoeConfig", "MoeDispatchConfig", "SortConfig", "W8A8MoeConfig",
           "default_config", "fused_moe", "sort_pairs"]
