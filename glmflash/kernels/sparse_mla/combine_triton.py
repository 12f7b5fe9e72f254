"""Merging the splits of a split sparse MLA launch (triton_impl.py, README.md "Combining splits").

Each split wrote its output normalised by its own softmax sum and its log2-sum-exp2;
`out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`, zeros where no split saw a slot. A
program merges one tile of heads x columns over every split, the splits' loads issued together,
so a merge costs about two round trips to L2 (the sums for M, then the partials), not one per
split.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.sparse_mla.plan import SparseMlaConfig, SparseMlaWorkspace, head_block
from glmflash.kernels.triton_utils import jit


@jit(do_not_specialize=("NUM_SPLITS", "lse_elem_stride"))
def sparse_mla_combine_kernel(part_o, part_lse, o, H, R, NUM_SPLITS, stride_ot, stride_oh,
                              lse_elem_stride, BH: tl.constexpr, BC: tl.constexpr,
                              SP: tl.constexpr):
    """out[query, BH heads, BC columns] from the NUM_SPLITS (<= SP) partials that
    `sparse_mla_kernel` wrote. The splits are unrolled loops over `[BH, BC]` tiles, so every
    thread sums its own elements' splits (no reduction across threads, no shared memory); the
    loads do not depend on each other, so they can all be issued before the first is used.

    Each split's log-sum-exp is loaded as a `[BH, BC]` tile of repeated addresses, its flat
    index times `lse_elem_stride` (1, the contiguous `[rows, H]` sums' element stride): a
    run-time value, so that Triton does not see those addresses as contiguous along the heads.
    It would then lay the load out heads-fastest, unlike the partials, and move every split's
    weights between the two layouts through shared memory (one barrier per split)."""
    i_t, i_h, i_c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    o_h = i_h * BH + tl.arange(0, BH)
    o_c = i_c * BC + tl.arange(0, BC)
    m_hc = (o_h < H)[:, None] & (o_c < R)[None, :]
    zero = tl.zeros([BH, BC], dtype=tl.int32)
    b_mx = tl.full([BH, BC], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SP):
        row = (i_t * NUM_SPLITS + s) * H + o_h[:, None] + zero  # [BH, BC]
        b_lse = tl.load(part_lse + row * lse_elem_stride, mask=m_hc & (zero + s < NUM_SPLITS),
                        other=float("-inf"))
        b_mx = tl.maximum(b_mx, b_lse)
    b_mx = tl.where(b_mx == float("-inf"), 0.0, b_mx)
    b_den = tl.zeros([BH, BC], dtype=tl.float32)
    b_out = tl.zeros([BH, BC], dtype=tl.float32)
    for s in tl.static_range(SP):
        m_s = m_hc & (zero + s < NUM_SPLITS)
        row = (i_t * NUM_SPLITS + s) * H + o_h[:, None] + zero
        b_lse = tl.load(part_lse + row * lse_elem_stride, mask=m_s, other=float("-inf"))
        b_w = tl.exp2(b_lse - b_mx)
        b_part = tl.load(part_o + row * R + o_c[None, :], mask=m_s, other=0.0,
                         cache_modifier=".cg")
        b_den += b_w
        b_out += b_w * b_part.to(tl.float32)
    b_out = b_out / tl.where(b_den > 0, b_den, 1.0)
    tl.store(o + i_t * stride_ot + o_h[:, None] * stride_oh + o_c[None, :],
             b_out.to(o.dtype.element_ty), mask=m_hc)


def splits_block(num_splits: int) -> int:
    """The splits axis of a combine tile: a power of two >= num_splits."""
    return triton.next_power_of_2(num_splits)


def combine_columns(num_splits: int, heads_block: int, rank: int, config: SparseMlaConfig) -> int:
    """Columns per combine program: what `config.combine_elements` leaves after splits x heads
    (a power of two, at least 1, at most the latent width)."""
    budget = config.combine_elements // (splits_block(num_splits) * heads_block)
    return max(1, min(triton.next_power_of_2(rank), 1 << max(budget, 1).bit_length() - 1))


def combine(workspace: SparseMlaWorkspace, out: torch.Tensor, num_splits: int,
            config: SparseMlaConfig) -> None:
    """The combine kernel over (query, `config.combine_heads` heads, columns) programs."""
    num_queries, heads, rank = out.shape
    bh = head_block(heads, config.combine_heads)
    bc = combine_columns(num_splits, bh, rank, config)
    sparse_mla_combine_kernel[(num_queries, triton.cdiv(heads, bh), triton.cdiv(rank, bc))](
        workspace.partial_out, workspace.partial_lse, out, heads, rank, num_splits,
        out.stride(0), out.stride(1), workspace.partial_lse.stride(1), BH=bh, BC=bc,
        SP=splits_block(num_splits), num_warps=4)
