"""Triton sparse MLA: absorbed-latent attention over each query's gathered cache slots (ref.py).

One program owns a query, a block of heads (the M of both products: 64 heads x one query) and a
range of the query's selected slots. It gathers those latent rows step by step, scores them
against every head of the block (an MQA over the one latent head) and keeps an fp32 online
softmax. With enough queries a program owns a whole selection (prefill); with few (decode) the
selection is split so that a wave of programs fills the GPU, each split writes its normalised
output and log-sum-exp to the caller's workspace, and the combine kernel merges them
(combine_triton.py, README.md).
"""

from __future__ import annotations

import logging

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.sparse_mla.combine_triton import combine
from glmflash.kernels.sparse_mla.plan import (
    DEFAULT_CONFIG,
    LOG2E,
    SparseMlaConfig,
    SparseMlaLaunch,
    SparseMlaWorkspace,
    SplitPlan,
    head_block,
    new_output,
    split_plan,
    wanted_splits,
)
from glmflash.kernels.triton_utils import dot_operand_type, jit, num_sms, product_precision

logger = logging.getLogger(__name__)

# (device, shapes tried, heads, rank, dtype) -> the launch shape that compiled there
_FITTED: dict[tuple, SparseMlaLaunch] = {}


@jit
def _step_slots(p_slot, w0, w_end, BN: tl.constexpr):
    """The selected slots p_slot[w0 : w0 + BN] (-1 from w_end on)."""
    o_n = w0 + tl.arange(0, BN)
    return tl.load(p_slot + o_n, mask=o_n < w_end, other=-1)


@jit
def online_softmax_step(s, valid, m, l_sum, scale_log2):
    """One step of the online softmax in log2 units over scores s [rows, slots] whose columns
    `valid` are real slots: (P, the rescale factor of what came before, the new row max, the
    new row sum). Also the Gluon kernel's (gluon_sm90.py)."""
    s = tl.where(tl.expand_dims(valid, 0), s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    # NOTE: rows that have seen no valid slot keep m = -inf; shift by 0 there (no NaN).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - tl.expand_dims(m_shift, 1))
    alpha = tl.exp2(m - m_shift)
    return p, alpha, m_new, l_sum * alpha + tl.sum(p, 1)


@jit
def _attend_step(b_q, latent, p_slot, idx, w0, b_m, b_l, b_acc, o_r, m_r, stride_l, scale_log2,
                 BN: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One step of the online softmax over the BN slots `idx` (p_slot[w0:], -1 = none)."""
    o_n = w0 + tl.arange(0, BN)
    valid = idx >= 0
    # NOTE: padded slots (-1) are masked, so they cost no memory traffic.
    b_kv = tl.load(latent + idx.to(tl.int64)[:, None] * stride_l + o_r[None, :],
                   mask=valid[:, None] & m_r[None, :], other=0.0,
                   cache_modifier=".cg").to(DOT)  # [BN, BR]
    b_s = tl.dot(b_q, tl.trans(b_kv), input_precision=PREC)  # [BH, BN]
    b_p, b_alpha, b_mn, b_l = online_softmax_step(b_s, valid, b_m, b_l, scale_log2)
    # NOTE: Triton lays a product whose result reaches another product (the scores reach the
    # value product) with every warp along M; with 64 rows and 8 warps both warpgroups would
    # compute all the scores. Results of a branch with a side effect are not followed, so the
    # scores are split by columns between the warpgroups instead. The branch is always taken
    # (w0 >= 0); the store in the other one never runs.
    if w0 >= 0:
        b_pd = b_p.to(DOT)
        b_acc = b_acc * b_alpha[:, None]
    else:
        tl.store(p_slot + o_n, idx, mask=o_n < w0)
        b_pd = tl.zeros_like(b_p).to(DOT)
    b_acc = tl.dot(b_pd, b_kv, b_acc, input_precision=PREC)  # [BH, BR]
    return b_mn, b_l, b_acc


@jit(do_not_specialize=("W", "NUM_SPLITS", "STEPS_PER", "EXTRA_STEPS", "FULL_W"))
def sparse_mla_kernel(q, latent, slots, o, part_o, part_lse, scale_log2, H, W, R, stride_qt,
                      stride_qh, stride_l, stride_s, stride_ot, stride_oh, NUM_SPLITS, STEPS_PER,
                      EXTRA_STEPS, FULL_W, BH: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                      TAIL_BN: tl.constexpr, NUM_STAGES: tl.constexpr, IS_SPLIT: tl.constexpr,
                      DOT: tl.constexpr, PREC: tl.constexpr):
    """Online-softmax attention of q[t, head block] over latent[slots[t, split's range]].

    Split s attends whole BN steps (STEPS_PER of them, one more for s < EXTRA_STEPS); the last
    split also attends the tail [FULL_W, W), in TAIL_BN steps. Unsplit: out directly; split:
    the normalised partial output and log2-sum-exp2 per (query, split, head), merged by the
    combine kernel (combine_triton.py).
    """
    i_t, i_hb, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_h = i_hb * BH + tl.arange(0, BH)
    o_r = tl.arange(0, BR)
    m_h, m_r = o_h < H, o_r < R
    b_q = tl.load(q + i_t * stride_qt + o_h[:, None] * stride_qh + o_r[None, :],
                  mask=m_h[:, None] & m_r[None, :], other=0.0).to(DOT)
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BR], dtype=tl.float32)
    p_slot = slots + i_t * stride_s
    w_begin = (i_s * STEPS_PER + tl.minimum(i_s, EXTRA_STEPS)) * BN
    w_end = w_begin + (STEPS_PER + (i_s < EXTRA_STEPS).to(tl.int32)) * BN
    is_last = i_s == NUM_SPLITS - 1
    if TAIL_BN == BN:
        # The last split's loop runs on into the tail, its final step masked.
        w_end = tl.where(is_last, W, w_end)
    for w0 in tl.range(w_begin, w_end, BN, num_stages=NUM_STAGES):
        idx = _step_slots(p_slot, w0, w_end, BN)
        b_m, b_l, b_acc = _attend_step(b_q, latent, p_slot, idx, w0, b_m, b_l, b_acc, o_r, m_r,
                                       stride_l, scale_log2, BN, DOT, PREC)
    if TAIL_BN < BN:
        # Narrower steps over the tail: the last split's only (an empty range for the others).
        for w0 in tl.range(tl.where(is_last, FULL_W, W), W, TAIL_BN, num_stages=NUM_STAGES):
            idx = _step_slots(p_slot, w0, W, TAIL_BN)
            b_m, b_l, b_acc = _attend_step(b_q, latent, p_slot, idx, w0, b_m, b_l, b_acc, o_r,
                                           m_r, stride_l, scale_log2, TAIL_BN, DOT, PREC)
    b_out = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    m_out = m_h[:, None] & m_r[None, :]
    if not IS_SPLIT:
        p_o = o + i_t * stride_ot + o_h[:, None] * stride_oh + o_r[None, :]
        tl.store(p_o, b_out.to(o.dtype.element_ty), mask=m_out)
    else:
        row = (i_t * NUM_SPLITS + i_s) * H + o_h  # [BH]
        tl.store(part_o + row[:, None] * R + o_r[None, :], b_out.to(part_o.dtype.element_ty),
                 mask=m_out)
        b_lse = tl.where(b_l > 0, b_m + tl.log2(tl.where(b_l > 0, b_l, 1.0)), float("-inf"))
        tl.store(part_lse + row, b_lse, mask=m_h)


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *, scale: float,
               config: SparseMlaConfig = DEFAULT_CONFIG,
               workspace: SparseMlaWorkspace | None = None) -> torch.Tensor:
    """Triton `sparse_mla_ref`: q_lat `[T, H, R]`, latent `[N, R]`, slots `[T, W]` (-1 = none).

    `workspace` holds the splits of a decode-sized launch (`sparse_mla_workspace`); without
    one, a split launch allocates its own. Host work depends on shapes only (CUDA graphs).
    """
    num_queries = q_lat.shape[0]
    out = new_output(q_lat, latent, slots)
    if num_queries == 0:
        return out
    split, shapes, key = _regime(q_lat, config)
    tried = (_FITTED[key],) if key in _FITTED else shapes
    for i, shape in enumerate(tried):
        try:
            _launch(q_lat, latent, slots, out, scale, shape, config, workspace, split)
        except triton.runtime.errors.OutOfResources as e:
            if i + 1 == len(tried):
                raise
            logger.info("sparse MLA: %s does not fit (%s); trying %s", shape, e, tried[i + 1])
            continue
        _FITTED[key] = shape
        return out
    raise AssertionError("unreachable")


def launch_plan(q_lat: torch.Tensor, slots: torch.Tensor, config: SparseMlaConfig = DEFAULT_CONFIG,
                workspace: SparseMlaWorkspace | None = None) -> tuple[SparseMlaLaunch, SplitPlan]:
    """What `sparse_mla` launches for these shapes: the launch shape (the one that fitted, once
    known) and the split."""
    split, shapes, key = _regime(q_lat, config)
    shape = _FITTED.get(key, shapes[0])
    return shape, _split(q_lat, slots, shape, config, workspace, split)


def _regime(q_lat: torch.Tensor, config: SparseMlaConfig
            ) -> tuple[bool, tuple[SparseMlaLaunch, ...], tuple]:
    """Whether the selection is split, the launch shapes to try, and the key of the one that
    fitted."""
    num_queries, heads, rank = q_lat.shape
    split = wanted_splits(num_queries, heads, num_sms(q_lat.device), config) > 1
    shapes = config.decode if split else config.prefill
    return split, shapes, (q_lat.device, shapes, heads, rank, q_lat.dtype)


def _split(q_lat, slots, shape: SparseMlaLaunch, config: SparseMlaConfig,
           workspace: SparseMlaWorkspace | None, split: bool) -> SplitPlan:
    num_queries, heads, rank = q_lat.shape
    width = slots.shape[1]
    if not split:
        full_steps = width // shape.block_slots
        return SplitPlan(1, full_steps, 0, full_steps)
    max_splits = workspace.max_splits(num_queries, heads, rank) if workspace else None
    return split_plan(num_queries, heads, width, shape.block_slots, num_sms(q_lat.device),
                      config, max_splits)


def _launch(q_lat, latent, slots, out, scale: float, shape: SparseMlaLaunch,
            config: SparseMlaConfig, workspace: SparseMlaWorkspace | None, split: bool) -> None:
    """The attention launch, and the combine launch of a split, with one launch shape."""
    num_queries, heads, rank = q_lat.shape
    plan = _split(q_lat, slots, shape, config, workspace, split)
    if plan.num_splits > 1 and workspace is None:
        workspace = SparseMlaWorkspace.create(num_queries, heads, rank, slots.shape[1],
                                              q_lat.device, num_sms(q_lat.device), config,
                                              out.dtype)
    _attend(q_lat, latent, slots, out, scale, shape, plan,
            workspace if plan.num_splits > 1 else None)
    if plan.num_splits > 1:
        combine(workspace, out, plan.num_splits, config)


def _attend(q_lat, latent, slots, out, scale: float, shape: SparseMlaLaunch, plan: SplitPlan,
            workspace: SparseMlaWorkspace | None) -> None:
    num_queries, heads, rank = q_lat.shape
    bh = head_block(heads)
    # Without a split the partials are never touched: `out` stands in for them.
    parts = (workspace.partial_out, workspace.partial_lse) if workspace is not None else (out, out)
    grid = (num_queries, triton.cdiv(heads, bh), plan.num_splits)
    sparse_mla_kernel[grid](
        q_lat, latent, slots, out, *parts, scale * LOG2E, heads, slots.shape[1], rank,
        q_lat.stride(0), q_lat.stride(1), latent.stride(0), slots.stride(0), out.stride(0),
        out.stride(1), plan.num_splits, plan.steps_per_split, plan.extra_steps,
        plan.full_steps * shape.block_slots, BH=bh, BR=max(16, triton.next_power_of_2(rank)),
        BN=shape.block_slots, TAIL_BN=shape.tail, NUM_STAGES=shape.num_stages,
        IS_SPLIT=workspace is not None,
        DOT=dot_operand_type(q_lat.dtype),
        PREC=product_precision(q_lat.dtype), num_warps=shape.num_warps)


__all__ = ["DEFAULT_CONFIG", "SparseMlaConfig", "SparseMlaLaunch", "SparseMlaWorkspace",
           "launch_plan", "sparse_mla", "sparse_mla_kernel"]
