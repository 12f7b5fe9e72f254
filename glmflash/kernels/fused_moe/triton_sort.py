"""The sorted block layout of the (token, slot) pairs in two grid-wide launches (histogram, then
scan and scatter), for prefill sizes where the one-launch form (triton_impl.py,
`fused_moe_align_kernel`: E programs, each scanning every pair) does O(E * T * k) work.

Same output as the one-launch form, bit for bit: each expert's pairs in pair order, padded with
the invalid pair id up to a multiple of BLOCK_M rows, groups in expert order, and each block's
expert (-1 past the last group). No atomics: every count is owned by one program.

1. `moe_count_kernel` (one program per CHUNK pairs): the chunk's histogram over the experts,
   one row of `counts [chunks, BINS]`;
2. `moe_scatter_kernel` (one program per chunk): sums every chunk's row (the totals) and the rows
   before its own (where its pairs start inside each group), places its pairs SUB at a time
   (rank among equal ids by a [SUB, SUB] comparison; the running offsets live in the program's
   own row of a scratch buffer so they can be gathered by id), then writes the expert and the
   padding rows of its share of the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit


@dataclass(frozen=True)
class SortConfig:
    """Which sort builds the layout, and the launch shape of the two-launch form."""

    scan_min_pairs: int = 1024
    """Pairs from which the two-launch form runs (below: the one-launch form, one kernel)."""
    chunk: int = 512
    """Pairs per program (a power of two, a multiple of `sub`; fused_moe/README.md has the
    sweep)."""
    sub: int = 128
    """Pairs ranked together (a [sub, sub] comparison)."""
    block_rows: int = 32
    """Blocks whose expert is found together (a [block_rows, BINS] comparison)."""
    num_warps: int = 4


SORT_CONFIG = SortConfig()


@jit
def moe_count_kernel(ids, counts, num_pairs, num_experts, CHUNK: tl.constexpr,
                     BINS: tl.constexpr):
    """counts[c, e] = pairs of chunk c routed to expert e (bin num_experts: ids outside range)."""
    i_c = tl.program_id(0)
    o_p = i_c * CHUNK + tl.arange(0, CHUNK)
    b_id = tl.load(ids + o_p, mask=o_p < num_pairs, other=-1)
    b_bin = tl.where((b_id >= 0) & (b_id < num_experts), b_id, num_experts).to(tl.int32)
    tl.store(counts + i_c * BINS + tl.arange(0, BINS), tl.histogram(b_bin, BINS))


@jit
def moe_scatter_kernel(ids, counts, offsets, sorted_pairs, block_expert, num_pairs,
                       num_experts, num_chunks, max_blocks, blocks_per_program,
                       BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                       BINS: tl.constexpr, BB: tl.constexpr):
    """Chunk c's pairs to their rows of the sorted layout, and blocks [c * blocks_per_program,
    (c + 1) * blocks_per_program): their expert and their padding rows."""
    i_c = tl.program_id(0)
    o_e = tl.arange(0, BINS)
    b_total = tl.zeros([BINS], dtype=tl.int32)
    b_before = tl.zeros([BINS], dtype=tl.int32)
    for c in range(0, num_chunks):
        b_row = tl.load(counts + c * BINS + o_e)
        b_total += b_row
        b_before += tl.where(c < i_c, b_row, 0)
    b_count = tl.where(o_e < num_experts, b_total, 0)  # [BINS]
    b_padded = (b_count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    b_start = tl.cumsum(b_padded, 0) - b_padded  # [BINS], each group's first row
    # The next free row of each group for this chunk's pairs, gathered by id below.
    p_next = offsets + i_c * BINS + o_e
    b_next = b_start + b_before
    tl.store(p_next, b_next)
    o_s = tl.arange(0, SUB)
    for s0 in range(0, CHUNK, SUB):
        tl.debug_barrier()
        o_p = i_c * CHUNK + s0 + o_s
        b_id = tl.load(ids + o_p, mask=o_p < num_pairs, other=-1)
        m_hit = (b_id >= 0) & (b_id < num_experts)
        b_bin = tl.where(m_hit, b_id, num_experts).to(tl.int32)
        b_base = tl.load(offsets + i_c * BINS + b_bin)  # [SUB]
        m_same = (b_bin[:, None] == b_bin[None, :]) & (o_s[None, :] < o_s[:, None])
        b_rank = tl.sum(m_same.to(tl.int32), 1)  # [SUB], equal ids before each pair
        tl.store(sorted_pairs + b_base + b_rank, o_p, mask=m_hit)
        tl.debug_barrier()
        b_next += tl.histogram(b_bin, BINS)
        tl.store(p_next, b_next)
    _mark_blocks(sorted_pairs, block_expert, b_start, b_count, b_padded, num_pairs, max_blocks,
                 i_c * blocks_per_program, blocks_per_program, BLOCK_M, BINS, BB)


@jit
def _mark_blocks(sorted_pairs, block_expert, b_start, b_count, b_padded, num_pairs, max_blocks,
                 first, num, BLOCK_M: tl.constexpr, BINS: tl.constexpr, BB: tl.constexpr):
    """Blocks [first, first + num): each one's expert (the number of groups ending at or before
    it; -1 past the last group) and num_pairs in its rows past its group's pairs."""
    o_e = tl.arange(0, BINS)
    b_end = (b_start + b_padded) // BLOCK_M  # [BINS], one past each group's last block
    b_fill = b_start + b_count  # [BINS], each group's first padding row
    num_used = tl.sum(b_padded, 0) // BLOCK_M
    o_r = tl.arange(0, BLOCK_M)
    for b0 in range(first, tl.minimum(first + num, max_blocks), BB):
        o_b = b0 + tl.arange(0, BB)
        m_b = o_b < tl.minimum(first + num, max_blocks)
        b_e = tl.sum((b_end[None, :] <= o_b[:, None]).to(tl.int32), 1)  # [BB]
        m_used = o_b < num_used
        tl.store(block_expert + o_b, tl.where(m_used, b_e, -1), mask=m_b)
        b_from = tl.sum(tl.where(o_e[None, :] == b_e[:, None], b_fill[None, :], 0), 1)  # [BB]
        o_row = o_b[:, None] * BLOCK_M + o_r[None, :]  # [BB, BLOCK_M]
        m_pad = (m_b & m_used)[:, None] & (o_row >= b_from[:, None])
        tl.store(sorted_pairs + o_row, tl.zeros([BB, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=m_pad)


def sort_pairs_scan(ids: torch.Tensor, num_experts: int, block_m: int, max_blocks: int,
                    config: SortConfig = SORT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted block layout of contiguous `ids` (see triton_impl.sort_pairs) in two launches;
    `max_blocks` is the bound from the shapes."""
    num_pairs = ids.numel()
    assert config.chunk % config.sub == 0
    bins = triton.next_power_of_2(num_experts + 1)
    num_chunks = triton.cdiv(num_pairs, config.chunk)
    counts = torch.empty(num_chunks, bins, dtype=torch.int32, device=ids.device)
    offsets = torch.empty_like(counts)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    moe_count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, CHUNK=config.chunk,
                                    BINS=bins, num_warps=config.num_warps)
    moe_scatter_kernel[(num_chunks,)](
        ids, counts, offsets, sorted_pairs, block_expert, num_pairs, num_experts, num_chunks,
        max_blocks, triton.cdiv(max_blocks, num_chunks), BLOCK_M=block_m, CHUNK=config.chunk,
        SUB=config.sub, BINS=bins, BB=config.block_rows, num_warps=config.num_warps)
    return sorted_pairs, block_expert


__all__ = ["SORT_CONFIG", "SortConfig", "moe_count_kernel", "moe_scatter_kernel",
           "sort_pairs_scan"]
