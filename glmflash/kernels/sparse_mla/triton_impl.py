"""Triton sparse MLA: absorbed-latent attention over gathered cache slots (see ref.py).

One program owns a query token, a block of heads, a block of output columns and a range of its
selected slots: it gathers those latent rows, scores them against all heads of the block (an MQA
over the one latent head) and keeps an fp32 online softmax. With several slot ranges per token
(decode: too few tokens to fill the GPU) the partial results are merged by a second kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import dot_operand_type, jit, num_sms, product_precision

logger = logging.getLogger(__name__)

BlockShape = tuple[int, int, int | None]
"""(output columns per program, slots per step, software pipeline stages or None for Triton's)."""


@dataclass(frozen=True)
class SparseMlaConfig:
    """Launch shapes of the sparse MLA kernel (README.md, "Launch shapes", says where they come
    from). Block shapes are tried in order; the first that fits the GPU's shared memory is kept."""

    narrow: tuple[BlockShape, ...] = ((128, 64, None), (128, 64, 1), (128, 32, 1))
    """Below `wide_tokens` queries: narrow output blocks give few queries more programs."""
    wide: tuple[BlockShape, ...] = ((512, 64, 2), (512, 32, 2), (512, 16, 2), (256, 32, 1),
                                    (128, 32, 1))
    """From `wide_tokens` queries: whole-rank blocks score each slot once."""
    wide_tokens: int = 16
    score_block: int = 128
    """Rank columns per score product when a program owns fewer output columns than the rank."""
    split_waves: float = 1.0
    """Programs per SM the split-slot decode aims for."""


DEFAULT_CONFIG = SparseMlaConfig()
# (device, block shapes tried, rank block, head block) -> the block shape that fitted there
_FITTED: dict[tuple, BlockShape] = {}


@jit
def sparse_mla_kernel(q, latent, slots, o, part_o, part_ml, scale, T, H, W, R,
                      stride_qt, stride_qh, stride_l, stride_s, stride_ot, stride_oh,
                      SPLIT_W, NUM_SPLITS: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
                      BH: tl.constexpr, BR: tl.constexpr, BRC: tl.constexpr, BRV: tl.constexpr,
                      BN: tl.constexpr, ONE_PIECE: tl.constexpr, DOT: tl.constexpr,
                      PREC: tl.constexpr):
    """Online-softmax attention of q[t, heads] over latent[slots[t, range]], output columns
    [i_rv * BRV, +BRV) only. Scores take the whole rank in BRC-wide pieces, so a program can own
    fewer output columns than the rank; with ONE_PIECE (BRC = BRV = BR) the latent tile of the
    scores is the value tile too, and q stays loaded across slot steps."""
    i_t, i_hr, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hb, i_rv = i_hr % HEAD_BLOCKS, i_hr // HEAD_BLOCKS
    o_h = i_hb * BH + tl.arange(0, BH)
    o_c = tl.arange(0, BRC)
    o_v = i_rv * BRV + tl.arange(0, BRV)
    m_h, m_v = o_h < H, o_v < R
    i_t64 = i_t.to(tl.int64)
    p_q = q + i_t64 * stride_qt + o_h[:, None] * stride_qh
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BRV], dtype=tl.float32)
    w_start = i_s * SPLIT_W
    w_end = tl.minimum(w_start + SPLIT_W, W)
    if ONE_PIECE:
        b_q1 = tl.load(p_q + o_c[None, :], mask=m_h[:, None] & (o_c < R)[None, :],
                       other=0.0).to(DOT)
    for w0 in range(w_start, w_end, BN):
        o_n = w0 + tl.arange(0, BN)
        idx = tl.load(slots + i_t64 * stride_s + o_n, mask=o_n < w_end, other=-1)
        valid = idx >= 0
        p_kv = latent + idx.to(tl.int64)[:, None] * stride_l
        if ONE_PIECE:
            b_kv = tl.load(p_kv + o_c[None, :], mask=valid[:, None] & (o_c < R)[None, :],
                           other=0.0).to(DOT)
            b_s = tl.dot(b_q1, tl.trans(b_kv), input_precision=PREC)
        else:
            b_s = tl.zeros([BH, BN], dtype=tl.float32)
            for r0 in tl.static_range(0, BR, BRC):
                m_c = r0 + o_c < R
                b_q = tl.load(p_q + r0 + o_c[None, :], mask=m_h[:, None] & m_c[None, :],
                              other=0.0)
                b_kc = tl.load(p_kv + r0 + o_c[None, :], mask=valid[:, None] & m_c[None, :],
                               other=0.0)
                b_s = tl.dot(b_q.to(DOT), tl.trans(b_kc.to(DOT)), b_s, input_precision=PREC)
        b_s = tl.where(valid[None, :], b_s * scale, float("-inf"))
        b_mn = tl.maximum(b_m, tl.max(b_s, 1))
        # NOTE: rows that have seen no valid slot keep m = -inf; shift by 0 there (no NaN).
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)
        b_p = tl.exp(b_s - b_ms[:, None])
        b_alpha = tl.exp(b_m - b_ms)
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if not ONE_PIECE:
            b_kv = tl.load(p_kv + o_v[None, :], mask=valid[:, None] & m_v[None, :],
                           other=0.0).to(DOT)
        b_acc = tl.dot(b_p.to(DOT), b_kv, b_acc * b_alpha[:, None], input_precision=PREC)
        b_m = b_mn
    m_out = m_h[:, None] & m_v[None, :]
    b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    if NUM_SPLITS == 1:
        p_o = o + i_t64 * stride_ot + o_h[:, None] * stride_oh + o_v[None, :]
        tl.store(p_o, b_out.to(o.dtype.element_ty), mask=m_out)
    else:
        # Partials: the normalised output of this range, and (m, l) to weight it.
        row = (i_t64 * NUM_SPLITS + i_s) * H + o_h
        tl.store(part_o + row[:, None] * R + o_v[None, :], b_out.to(part_o.dtype.element_ty),
                 mask=m_out)
        if i_rv == 0:
            tl.store(part_ml + row * 2, b_m, mask=m_h)
            tl.store(part_ml + row * 2 + 1, b_l, mask=m_h)


@jit
def sparse_mla_combine_kernel(part_o, part_ml, o, H, R, stride_ot, stride_oh,
                              NUM_SPLITS: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr):
    """out[t, h] = sum_s l_s e^(m_s - M) o_s / sum_s l_s e^(m_s - M); zeros if nothing valid."""
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_s = tl.arange(0, BS)
    o_r = tl.arange(0, BR)
    m_s = o_s < NUM_SPLITS
    row = (i_t * NUM_SPLITS + o_s) * H + i_h
    b_m = tl.load(part_ml + row * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(part_ml + row * 2 + 1, mask=m_s, other=0.0)
    b_mx = tl.max(b_m, 0)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_w = b_l * tl.exp(b_m - b_mx)  # [BS]
    b_o = tl.load(part_o + row[:, None] * R + o_r[None, :], mask=m_s[:, None] & (o_r < R)[None, :],
                  other=0.0).to(tl.float32)
    b_sum = tl.sum(b_w, 0)
    b_out = tl.sum(b_o * b_w[:, None], 0) / tl.where(b_sum > 0, b_sum, 1.0)
    tl.store(o + i_t * stride_ot + i_h * stride_oh + o_r, b_out.to(o.dtype.element_ty),
             mask=o_r < R)


def _num_splits(programs: int, width: int, bn: int, device: torch.device, waves: float) -> int:
    """Slot ranges per token so that about `waves` programs run per SM, each range at least one
    bn-slot step."""
    if programs == 0 or width == 0:
        return 1
    want = int(num_sms(device) * waves) // programs
    return max(1, min(want, triton.cdiv(width, bn)))


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
               scale: float, config: SparseMlaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Triton `sparse_mla_ref`: q_lat `[T, H, R]`, latent `[N, R]`, slots `[T, W]` (-1 = none)."""
    num_tokens, heads, rank = q_lat.shape
    assert latent.shape[1] == rank and slots.shape[0] == num_tokens
    assert q_lat.stride(2) == 1 and latent.stride(1) == 1 and slots.stride(1) == 1
    out = torch.empty(num_tokens, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if num_tokens == 0:
        return out
    slots = slots if slots.dtype in (torch.int32, torch.int64) else slots.long()
    br = triton.next_power_of_2(rank)
    bh = 64 if heads > 32 else max(16, triton.next_power_of_2(heads))
    shapes = config.wide if num_tokens >= config.wide_tokens else config.narrow
    key = (q_lat.device, shapes, br, bh)
    tried = (_FITTED[key],) if key in _FITTED else shapes
    for i, shape in enumerate(tried):
        try:
            _launch(q_lat, latent, slots, out, scale, br, bh, shape, config)
        except triton.runtime.errors.OutOfResources as e:
            if i + 1 == len(tried):
                raise
            logger.info("sparse MLA: blocks %s do not fit (%s); trying %s", shape, e,
                        tried[i + 1])
            continue
        _FITTED[key] = shape
        return out
    raise AssertionError("unreachable")


def _launch(q_lat, latent, slots, out, scale: float, br: int, bh: int, shape: BlockShape,
            config: SparseMlaConfig) -> None:
    """One attention launch (and the merge of slot ranges) with the given block sizes."""
    num_tokens, heads, rank = q_lat.shape
    value_block, bn, stages = shape
    width = slots.shape[1]
    brv = min(value_block, br)
    # One piece: the score tile doubles as the value tile.
    brc = br if brv == br else min(config.score_block, br)
    head_blocks = triton.cdiv(heads, bh)
    value_blocks = br // brv
    splits = _num_splits(num_tokens * head_blocks * value_blocks, width, bn, q_lat.device,
                         config.split_waves)
    split_w = triton.cdiv(triton.cdiv(width, splits), bn) * bn if width else bn
    splits = triton.cdiv(width, split_w) if width else 1
    part_dt = torch.float32 if q_lat.dtype == torch.float32 else q_lat.dtype
    part_o = torch.empty(num_tokens * splits * heads, rank, dtype=part_dt,
                         device=q_lat.device) if splits > 1 else out
    part_ml = torch.empty(num_tokens * splits * heads, 2, dtype=torch.float32,
                          device=q_lat.device) if splits > 1 else out
    sparse_mla_kernel[(num_tokens, head_blocks * value_blocks, splits)](
        q_lat, latent, slots, out, part_o, part_ml, scale, num_tokens, heads, width, rank,
        q_lat.stride(0), q_lat.stride(1), latent.stride(0), slots.stride(0), out.stride(0),
        out.stride(1), split_w, NUM_SPLITS=splits, HEAD_BLOCKS=head_blocks, BH=bh, BR=br,
        BRC=brc, BRV=brv, BN=bn, ONE_PIECE=brc == br and brv == br,
        DOT=dot_operand_type(q_lat.dtype), PREC=product_precision(q_lat.dtype),
        num_warps=8 if bh * brv >= 64 * 256 else 4,
        **({} if stages is None else {"num_stages": stages}))
    if splits > 1:
        sparse_mla_combine_kernel[(num_tokens, heads)](
            part_o, part_ml, out, heads, rank, out.stride(0), out.stride(1), NUM_SPLITS=splits,
            BS=triton.next_power_of_2(splits), BR=br, num_warps=4)


__all__ = ["DEFAULT_CONFIG", "SparseMlaConfig", "sparse_mla"]
