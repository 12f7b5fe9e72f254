"""Exact top-k of each row's first `lengths[row]` scores: a radix select in Triton.

Each fp32 score maps to a 32-bit key with the same order; the select fixes the threshold key
one byte at a time, from the top. Rows are cut into segments, one program per (row, segment):

1. a histogram launch over every key: each program adds its segment's 256 counts of the first
   key byte into `hist[row, 0]` and keeps them in `seg_hist[row, segment, 0]`; the first byte
   of the k-th largest key is then fixed (every later program recomputes it from `hist`);
2. the second and third byte launches; one of them also lists each segment's candidates, in
   index order, in its own part of `cand`: the indices of the keys at or above the threshold's
   bytes fixed so far (every key the select can take), then counts its byte over the list.
   The list is taken after the first byte when at most `1 / list_divisor` of the row's keys
   are candidates then (the usual case: the k largest and the keys sharing their lowest first
   byte); otherwise (every score within a factor of four, say) the second byte is counted over
   every key and the list taken after it;
3. a fourth byte launch over the candidates alone; each program also keeps how many of its
   keys are above the first three bytes and how many reach each last byte;
4. a write launch over the candidates: from what the segments before it kept, each program
   knows where its keys go: the indices above the threshold in index order, then the first
   ties by index, then -1 up to k.

So two or three of the five launches read every score (one of them a compare and a store of
indices, not a histogram); the rest read a few percent of them.

The chosen set is the k largest of `scores[row, :lengths[row]]`, ties going to the lower index
(-0.0 counts as +0.0; NaN has no defined place). Scores past a row's length are never read.
Every shape comes from host integers and nothing is read back: CUDA graphs capture the select at
a fixed width while the lengths stay on the device, and a short row costs only its own segments.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import constexpr, jit, num_sms

NUM_PASSES = constexpr(4)  # 32-bit keys, one byte a pass
NUM_BINS = constexpr(256)
INT32_MIN = constexpr(-(1 << 31))


@dataclass(frozen=True)
class TopkConfig:
    """Launch shape of the select."""

    block: int = 1024
    """Keys a program handles per loop step (a power of two)."""
    min_segment: int = 1024
    """The fewest keys of a row one program takes (a multiple of `block`)."""
    programs_per_sm: int = 4
    """Programs aimed for per SM when the rows are long enough to fill them (the programs are
    latency-bound: more of them hide more of it; bench/sweeps.py --ops topk)."""
    num_warps: int = 4
    few_programs_warps: int = 8
    """Warps per program when the grid has fewer programs than the device has SMs (one short
    row): more warps hide more of the latency."""
    list_divisor: int = 4
    """The candidates are listed after the first byte when at most 1 / list_divisor of a row's
    keys reach its threshold's first byte, else after the second byte."""

    def segment(self, num_rows: int, width: int, device: torch.device) -> int:
        """Keys per program: the rows spread over about `programs_per_sm` programs per SM."""
        per_row = max(1, num_sms(device) * self.programs_per_sm // max(num_rows, 1))
        seg = max(self.min_segment, -(-width // per_row))
        return -(-seg // self.block) * self.block

    def warps(self, num_programs: int, device: torch.device) -> int:
        """Warps per program of a grid of `num_programs`."""
        return self.few_programs_warps if num_programs < num_sms(device) else self.num_warps


DEFAULT_CONFIG = TopkConfig()


@jit
def _order_keys(b_x):
    """int32 keys whose signed order is the order of the scores `b_x` (-0.0 mapped to +0.0)."""
    b_x = tl.where(b_x == 0.0, 0.0, b_x)
    bits = b_x.to(tl.int32, bitcast=True)
    # Negative floats order backwards in their bits: flip all but the sign.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _fixed_bytes(p_hist, k, PASSES: tl.constexpr):
    """After `PASSES` histogram launches: the fixed top bytes of the threshold key (unsigned
    form, lower bytes 0) and how many keys sharing them are still to be taken."""
    o_b = tl.arange(0, NUM_BINS)
    prefix = k * 0
    need = k + 0
    for p in tl.static_range(PASSES):
        b_h = tl.load(p_hist + p * NUM_BINS + o_b)  # [NUM_BINS]
        # Keys whose byte is >= b; the k-th largest sits in the highest byte reaching `need`.
        at_least = tl.sum(b_h, 0) - tl.cumsum(b_h, 0) + b_h
        digit = tl.max(tl.where(at_least >= need, o_b, 0), 0)
        need -= tl.sum(tl.where(o_b > digit, b_h, 0), 0)
        prefix = prefix | (digit << (24 - 8 * p))
    return prefix, need


@jit
def _count_byte(b_acc, b_u, m_k, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """`b_acc` plus the counts of byte PASS of the keys `b_u` (unsigned order) in `m_k` that
    share the bytes fixed before it (`prefix`)."""
    if PASS > 0:
        m_k = m_k & ((b_u >> (32 - 8 * PASS)) == (prefix >> (32 - 8 * PASS)))
    num_out = BLOCK - tl.sum(m_k.to(tl.int32), 0)
    if num_out < BLOCK:
        b_digit = (b_u >> (24 - 8 * PASS)) & 0xFF
        # Keys left out count in bin 0 and are taken off again.
        b_acc += tl.histogram(tl.where(m_k, b_digit, 0), NUM_BINS)
        b_acc -= tl.where(tl.arange(0, NUM_BINS) == 0, num_out, 0)
    return b_acc


@jit
def _count_candidates(p_row, p_cand, num_cand, prefix, PASS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """Counts of byte PASS over a segment's `num_cand` candidates (indices at `p_cand`)."""
    b_acc = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(0, num_cand, BLOCK):
        o_c = start + tl.arange(0, BLOCK)
        m_c = o_c < num_cand
        b_i = tl.load(p_cand + o_c, mask=m_c, other=0)
        b_u = _order_keys(tl.load(p_row + b_i, mask=m_c, other=0.0)) ^ INT32_MIN
        b_acc = _count_byte(b_acc, b_u, m_c, prefix, PASS, BLOCK)
    return b_acc


@jit
def _add_counts(hist, seg_hist, b_acc, b_keep, i_r, i_s, stride_sh, PASS: tl.constexpr):
    """hist[row, PASS] += the segment's counts `b_acc`; seg_hist[row, segment, PASS] =
    `b_keep` (the counts, or on the last pass how many reach each byte)."""
    o_b = tl.arange(0, NUM_BINS)
    p_hist = hist + i_r * (NUM_PASSES * NUM_BINS) + PASS * NUM_BINS
    tl.atomic_add(p_hist + o_b, b_acc, mask=b_acc > 0)
    p_seg = seg_hist + i_r.to(tl.int64) * stride_sh + i_s * (NUM_PASSES * NUM_BINS)
    tl.store(p_seg + PASS * NUM_BINS + o_b, b_keep)


@jit
def _above_fixed_bytes(p_seg, prefix, PASSES: tl.constexpr):
    """Keys of a segment above every key that shares the first PASSES bytes of `prefix`: those
    whose first byte that differs from it is larger, from the segment's histograms."""
    o_b = tl.arange(0, NUM_BINS)
    num = tl.sum(tl.zeros([NUM_BINS], dtype=tl.int32), 0)
    for p in tl.static_range(PASSES):
        digit = (prefix >> (24 - 8 * p)) & 0xFF
        num += tl.sum(tl.where(o_b > digit, tl.load(p_seg + p * NUM_BINS + o_b), 0), 0)
    return num


@jit
def _count_keys(p_row, begin, end, prefix, PASS: tl.constexpr, BLOCK: tl.constexpr):
    """Counts of byte PASS over the keys in [begin, end) that share the bytes before it."""
    b_acc = tl.zeros([NUM_BINS], dtype=tl.int32)
    for start in range(begin, end, BLOCK):
        o_k = start + tl.arange(0, BLOCK)
        m_k = o_k < end
        b_u = _order_keys(tl.load(p_row + o_k, mask=m_k, other=0.0)) ^ INT32_MIN
        b_acc = _count_byte(b_acc, b_u, m_k, prefix, PASS, BLOCK)
    return b_acc


@jit
def _listed_after_first_byte(p_hist, k, length, LIST_DIVISOR: tl.constexpr):
    """Whether the row's candidates are listed after its first byte: the keys whose first
    byte reaches the threshold's are at most 1 / LIST_DIVISOR of its keys."""
    o_b = tl.arange(0, NUM_BINS)
    b_h = tl.load(p_hist + o_b)
    at_least = tl.sum(b_h, 0) - tl.cumsum(b_h, 0) + b_h
    reached = tl.min(tl.where(at_least >= k, at_least, length), 0)
    return reached.to(tl.int64) * LIST_DIVISOR <= length


@jit
def _list_candidates(p_row, p_cand, begin, end, prefix, BLOCK: tl.constexpr):
    """Writes at `p_cand`, in order, the indices in [begin, end) whose keys are at least
    `prefix` (unsigned form, lower bytes 0), and returns their count. The list is then visible
    to every thread of the program."""
    lowest = prefix ^ INT32_MIN  # the same bound on signed keys
    num = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    for start in range(begin, end, BLOCK):
        o_k = start + tl.arange(0, BLOCK)
        m_k = o_k < end
        m_c = m_k & (_order_keys(tl.load(p_row + o_k, mask=m_k, other=0.0)) >= lowest)
        r_c = num + tl.cumsum(m_c.to(tl.int32), 0) - 1
        tl.store(p_cand + r_c, o_k, mask=m_c)
        num += tl.sum(m_c.to(tl.int32), 0)
    tl.debug_barrier()
    return num


@jit(do_not_specialize=("k", "seg_len"))
def topk_byte_kernel(scores, lengths, hist, seg_hist, above, cand, num_cand, k, seg_len,
                     stride_s, stride_sh, stride_a, stride_c, stride_n, PASS: tl.constexpr,
                     LIST_DIVISOR: tl.constexpr, BLOCK: tl.constexpr):
    """hist[row, PASS] += counts of byte PASS over this segment's keys that share the bytes
    fixed before it: over every key before the row's candidates are listed, then over the
    list, which the pass that takes it writes (cand[row, begin:begin + n], num_cand[row,
    segment] = n) after fixing the bytes before it. The last pass keeps, per segment, how
    many of its keys reach each last byte and (above[row, segment]) how many are above the
    first three bytes: what the write needs to place the segment's keys."""
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    length = tl.load(lengths + i_r)
    begin = i_s * seg_len
    if (length > k) & (begin < length):
        p_hist = hist + i_r * (NUM_PASSES * NUM_BINS)
        end = tl.minimum(begin + seg_len, length)
        p_row = scores + i_r.to(tl.int64) * stride_s
        if PASS == 0:
            b_acc = _count_keys(p_row, begin, end, 0, PASS, BLOCK)
        else:
            prefix, _ = _fixed_bytes(p_hist, k, PASS)
            early = _listed_after_first_byte(p_hist, k, length, LIST_DIVISOR)
            list_pass = 2 - early.to(tl.int32)
            if PASS < list_pass:
                b_acc = _count_keys(p_row, begin, end, prefix, PASS, BLOCK)
            else:
                p_cand = cand + i_r.to(tl.int64) * stride_c + begin
                p_num = num_cand + i_r.to(tl.int64) * stride_n + i_s
                if PASS == list_pass:
                    num = _list_candidates(p_row, p_cand, begin, end, prefix, BLOCK)
                    tl.store(p_num, num)
                else:
                    num = tl.load(p_num)
                b_acc = _count_candidates(p_row, p_cand, num, prefix, PASS, BLOCK)
        if PASS == NUM_PASSES - 1:
            b_keep = tl.sum(b_acc, 0) - tl.cumsum(b_acc, 0) + b_acc
            p_seg = seg_hist + i_r.to(tl.int64) * stride_sh + i_s * (NUM_PASSES * NUM_BINS)
            tl.store(above + i_r.to(tl.int64) * stride_a + i_s,
                     _above_fixed_bytes(p_seg, prefix, PASS))
        else:
            b_keep = b_acc
        _add_counts(hist, seg_hist, b_acc, b_keep, i_r, i_s, stride_sh, PASS)


@jit
def _before(p_above, p_last, i_s, digit, BLOCK: tl.constexpr):
    """Keys above the threshold and ties to it in the segments before `i_s`: each segment's
    keys above its first three bytes (`p_above`), plus its keys sharing them whose last byte
    is above `digit` (`p_last`: per segment, how many reach each last byte)."""
    num_gt = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    num_eq = num_gt + 0
    for s0 in range(0, i_s, BLOCK):
        o_s = s0 + tl.arange(0, BLOCK)
        m_s = o_s < i_s
        p_seg = p_last + o_s.to(tl.int64) * (NUM_PASSES * NUM_BINS) + digit
        reach = tl.load(p_seg, mask=m_s, other=0)
        past = tl.load(p_seg + 1, mask=m_s & (o_s * 0 + digit < NUM_BINS - 1), other=0)
        num_gt += tl.sum(tl.load(p_above + o_s, mask=m_s, other=0) + past, 0)
        num_eq += tl.sum(reach - past, 0)
    return num_gt, num_eq


@jit(do_not_specialize=("k", "seg_len"))
def topk_write_kernel(scores, lengths, hist, seg_hist, above, cand, num_cand, out, k, seg_len,
                      stride_s, stride_sh, stride_a, stride_c, stride_n, stride_o,
                      BLOCK: tl.constexpr):
    """out[row] = chosen indices (above the threshold, then ties by index), then -1."""
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    length = tl.load(lengths + i_r)
    begin = i_s * seg_len
    p_out = out + i_r.to(tl.int64) * stride_o
    if i_s == 0:
        for start in range(0, k, BLOCK):
            o_k = start + tl.arange(0, BLOCK)
            tl.store(p_out + o_k, tl.full([BLOCK], -1, tl.int32),
                     mask=(o_k < k) & (o_k >= length))
    if begin < length:
        if length <= k:
            end = tl.minimum(begin + seg_len, length)
            for start in range(begin, end, BLOCK):
                o_k = start + tl.arange(0, BLOCK)
                tl.store(p_out + o_k, o_k, mask=o_k < end)
        else:
            prefix, need = _fixed_bytes(hist + i_r * (NUM_PASSES * NUM_BINS), k, NUM_PASSES)
            threshold = prefix ^ INT32_MIN
            p_last = seg_hist + i_r.to(tl.int64) * stride_sh + (NUM_PASSES - 1) * NUM_BINS
            num_gt, num_eq = _before(above + i_r.to(tl.int64) * stride_a, p_last, i_s,
                                     prefix & 0xFF, BLOCK)
            p_row = scores + i_r.to(tl.int64) * stride_s
            p_cand = cand + i_r.to(tl.int64) * stride_c + begin
            num = tl.load(num_cand + i_r.to(tl.int64) * stride_n + i_s)
            for start in range(0, num, BLOCK):
                o_c = start + tl.arange(0, BLOCK)
                m_c = o_c < num
                b_i = tl.load(p_cand + o_c, mask=m_c, other=0)
                b_key = _order_keys(tl.load(p_row + b_i, mask=m_c, other=0.0))
                m_gt = m_c & (b_key > threshold)
                m_eq = m_c & (b_key == threshold)
                r_gt = num_gt + tl.cumsum(m_gt.to(tl.int32), 0) - 1
                r_eq = num_eq + tl.cumsum(m_eq.to(tl.int32), 0) - 1
                tl.store(p_out + r_gt, b_i, mask=m_gt)
                tl.store(p_out + (k - need) + r_eq, b_i, mask=m_eq & (r_eq < need))
                num_gt += tl.sum(m_gt.to(tl.int32), 0)
                num_eq += tl.sum(m_eq.to(tl.int32), 0)


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, *,
                 config: TopkConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Indices `[R, k]` int32 of the k largest of `scores[r, :lengths[r]]` (ties to the lower
    index), -1 where a row has fewer than k. scores `[R, W]` fp32 with unit column stride,
    lengths `[R]` int32 (each at most W) on the scores' device. Workspace: an int32 candidate
    list as large as the scores, and a few KB per segment."""
    num_rows, width = scores.shape
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    assert lengths.shape == (num_rows,) and lengths.dtype == torch.int32
    assert k >= 1 and config.block & (config.block - 1) == 0
    assert config.min_segment % config.block == 0
    device = scores.device
    out = torch.empty(num_rows, k, dtype=torch.int32, device=device)
    if num_rows == 0:
        return out
    seg_len = config.segment(num_rows, width, device)
    grid = (num_rows, triton.cdiv(max(width, 1), seg_len))
    hist = torch.zeros(num_rows, NUM_PASSES, NUM_BINS, dtype=torch.int32, device=device)
    seg_hist = torch.empty(num_rows, grid[1], NUM_PASSES, NUM_BINS, dtype=torch.int32,
                           device=device)
    cand = torch.empty(num_rows, max(width, 1), dtype=torch.int32, device=device)
    num_cand = torch.empty(num_rows, grid[1], dtype=torch.int32, device=device)
    above = torch.empty(num_rows, grid[1], dtype=torch.int32, device=device)
    common = dict(BLOCK=config.block, num_warps=config.warps(grid[0] * grid[1], device))
    workspace = (hist, seg_hist, above, cand, num_cand)
    strides = (seg_hist.stride(0), above.stride(0), cand.stride(0), num_cand.stride(0))
    for p in range(NUM_PASSES):
        topk_byte_kernel[grid](scores, lengths, *workspace, k, seg_len, scores.stride(0),
                               *strides, PASS=p, LIST_DIVISOR=config.list_divisor, **common)
    topk_write_kernel[grid](scores, lengths, *workspace, out, k, seg_len, scores.stride(0),
                            *strides, out.stride(0), **common)
    return out


__all__ = ["DEFAULT_CONFIG", "TopkConfig", "topk_indices"]
