"""Exact top-k of each row's first `lengths[row]` scores: a radix select in Triton.

Each fp32 score maps to a 32-bit key with the same order; the select fixes the threshold key
one digit at a time, from the top (`TopkConfig.digit_bits`: 8, four passes of 256 bins, or 4,
eight passes of 16). Rows are cut into segments, one program per (row, segment):

1. one histogram launch per digit: launch p counts the p-th digit of the keys that share the
   digits already fixed, each program adding its segment's counts into `hist[row, p]` and
   keeping them in `seg_hist[row, segment, p]`; the digit holding the k-th largest key is then
   fixed (every later program recomputes it from `hist`);
2. a count launch: per segment, from its own histograms and no key, the keys above the
   threshold (those whose first digit that differs from it is larger) and the keys equal to it;
3. a write launch: the indices of the keys above the threshold in index order, then the first
   ties by index, then -1 up to k.

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

INT32_MIN = constexpr(-(1 << 31))


@dataclass(frozen=True)
class TopkConfig:
    """Launch shape of the select."""

    block: int = 1024
    """Keys a program handles per loop step (a power of two)."""
    min_segment: int = 1024
    """The fewest keys of a row one program takes (a multiple of `block`)."""
    programs_per_sm: int = 8
    """Programs aimed for per SM when the rows are long enough to fill them (the programs are
    latency-bound: more of them hide more of it; bench/sweeps.py --ops topk)."""
    num_warps: int = 4
    digit_bits: int = 8
    """Key bits fixed per pass: 8 (four histogram passes of 256 bins) or 4 (eight passes of 16
    bins: a cheaper histogram per key, twice the passes)."""

    def __post_init__(self) -> None:
        if self.digit_bits not in (4, 8):
            raise ValueError(f"digit_bits {self.digit_bits}: 4 or 8")

    @property
    def passes(self) -> int:
        return 32 // self.digit_bits

    @property
    def bins(self) -> int:
        """Histogram width: the digit's values, at least 32 (Triton's histogram is kept at a
        warp's width or more; bins past the digit's values stay empty)."""
        return max(1 << self.digit_bits, 32)

    def segment(self, num_rows: int, width: int, device: torch.device) -> int:
        """Keys per program: the rows spread over about `programs_per_sm` programs per SM."""
        per_row = max(1, num_sms(device) * self.programs_per_sm // max(num_rows, 1))
        seg = max(self.min_segment, -(-width // per_row))
        return -(-seg // self.block) * self.block


DEFAULT_CONFIG = TopkConfig()
LONG_ROWS_CONFIG = TopkConfig(digit_bits=4)


@dataclass(frozen=True)
class TopkRule:
    """The select's launch by size: `long_rows` when the rows hold at least `min_keys` keys in
    all (work enough that every pass streams, so cheaper histograms pay for more passes),
    `short` otherwise (latency-bound passes: the fewer the better)."""

    short: TopkConfig = DEFAULT_CONFIG
    long_rows: TopkConfig = LONG_ROWS_CONFIG
    min_keys: int = 1 << 62

    def pick(self, num_rows: int, width: int) -> TopkConfig:
        return self.long_rows if num_rows * width >= self.min_keys else self.short


DEFAULT_RULE = TopkRule()


@jit
def _order_keys(p_x, mask):
    """int32 keys whose signed order is the scores' order (-0.0 mapped to +0.0)."""
    b_x = tl.load(p_x, mask=mask, other=0.0)
    b_x = tl.where(b_x == 0.0, 0.0, b_x)
    bits = b_x.to(tl.int32, bitcast=True)
    # Negative floats order backwards in their bits: flip all but the sign.
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _fixed_digits(p_hist, k, PASSES: tl.constexpr, DIGIT: tl.constexpr, BINS: tl.constexpr):
    """After `PASSES` histogram launches: the fixed top digits of the threshold key (unsigned
    form, lower bits 0) and how many keys sharing them are still to be taken."""
    o_b = tl.arange(0, BINS)
    prefix = k * 0
    need = k + 0
    for p in tl.static_range(PASSES):
        b_h = tl.load(p_hist + p * BINS + o_b)  # [BINS]
        # Keys whose digit is >= b; the k-th largest sits in the highest digit reaching `need`.
        at_least = tl.sum(b_h, 0) - tl.cumsum(b_h, 0) + b_h
        digit = tl.max(tl.where(at_least >= need, o_b, 0), 0)
        need -= tl.sum(tl.where(o_b > digit, b_h, 0), 0)
        prefix = prefix | (digit << (32 - DIGIT * (p + 1)))
    return prefix, need


@jit(do_not_specialize=("k", "seg_len"))
def topk_histogram_kernel(scores, lengths, hist, seg_hist, k, seg_len, stride_s, stride_sh,
                          PASS: tl.constexpr, BLOCK: tl.constexpr, DIGIT: tl.constexpr,
                          BINS: tl.constexpr):
    """hist[row, PASS] += counts of digit PASS over this segment's keys that match the digits
    fixed by the earlier passes; seg_hist[row, segment, PASS] = the same counts."""
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    length = tl.load(lengths + i_r)
    begin = i_s * seg_len
    if (length > k) & (begin < length):
        p_hist = hist + i_r * ((32 // DIGIT) * BINS)
        prefix, need = _fixed_digits(p_hist, k, PASS, DIGIT, BINS)
        end = tl.minimum(begin + seg_len, length)
        o_b = tl.arange(0, BINS)
        b_acc = tl.zeros([BINS], dtype=tl.int32)
        p_row = scores + i_r.to(tl.int64) * stride_s
        for start in range(begin, end, BLOCK):
            o_k = start + tl.arange(0, BLOCK)
            m_k = o_k < end
            b_u = _order_keys(p_row + o_k, m_k) ^ INT32_MIN  # [BLOCK] unsigned order
            if PASS > 0:
                m_k = m_k & ((b_u >> (32 - DIGIT * PASS)) == (prefix >> (32 - DIGIT * PASS)))
            num_out = BLOCK - tl.sum(m_k.to(tl.int32), 0)
            if num_out < BLOCK:
                b_digit = (b_u >> (32 - DIGIT * (PASS + 1))) & ((1 << DIGIT) - 1)
                # Keys left out count in bin 0 and are taken off again.
                b_acc += tl.histogram(tl.where(m_k, b_digit, 0), BINS)
                b_acc -= tl.where(o_b == 0, num_out, 0)
        tl.atomic_add(p_hist + PASS * BINS + o_b, b_acc, mask=b_acc > 0)
        p_seg = seg_hist + i_r.to(tl.int64) * stride_sh + i_s * ((32 // DIGIT) * BINS)
        tl.store(p_seg + PASS * BINS + o_b, b_acc)


@jit(do_not_specialize=("k", "seg_len"))
def topk_count_kernel(lengths, hist, seg_hist, counts, k, seg_len, stride_sh, stride_c,
                      DIGIT: tl.constexpr, BINS: tl.constexpr):
    """counts[row, seg] = (keys above the threshold, keys equal to it) in the segment, from its
    histograms: a key is above when its first digit that differs from the threshold's is
    larger, so each pass adds the keys of its histogram above the digit it fixed."""
    i_r = tl.program_id(0)
    i_s = tl.program_id(1)
    length = tl.load(lengths + i_r)
    if (length > k) & (i_s * seg_len < length):
        p_hist = hist + i_r * ((32 // DIGIT) * BINS)
        p_seg = seg_hist + i_r.to(tl.int64) * stride_sh + i_s * ((32 // DIGIT) * BINS)
        o_b = tl.arange(0, BINS)
        prefix, _ = _fixed_digits(p_hist, k, 32 // DIGIT, DIGIT, BINS)
        num_gt = tl.sum(tl.zeros([BINS], dtype=tl.int32), 0)
        num_eq = num_gt + 0
        for p in tl.static_range(32 // DIGIT):
            digit = (prefix >> (32 - DIGIT * (p + 1))) & ((1 << DIGIT) - 1)
            b_h = tl.load(p_seg + p * BINS + o_b)
            num_gt += tl.sum(tl.where(o_b > digit, b_h, 0), 0)
            if p == 32 // DIGIT - 1:
                num_eq = tl.sum(tl.where(o_b == digit, b_h, 0), 0)
        p_c = counts + i_r.to(tl.int64) * stride_c + 2 * i_s
        tl.store(p_c, num_gt)
        tl.store(p_c + 1, num_eq)


@jit
def _before(p_counts, i_s, BLOCK: tl.constexpr):
    """Keys above the threshold and ties in the segments before `i_s`."""
    num_gt = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    num_eq = num_gt + 0
    for s0 in range(0, i_s, BLOCK):
        o_s = s0 + tl.arange(0, BLOCK)
        m_s = o_s < i_s
        num_gt += tl.sum(tl.load(p_counts + 2 * o_s, mask=m_s, other=0), 0)
        num_eq += tl.sum(tl.load(p_counts + 2 * o_s + 1, mask=m_s, other=0), 0)
    return num_gt, num_eq


@jit(do_not_specialize=("k", "seg_len"))
def topk_write_kernel(scores, lengths, hist, counts, out, k, seg_len, stride_s, stride_c,
                      stride_o, BLOCK: tl.constexpr, DIGIT: tl.constexpr, BINS: tl.constexpr):
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
        end = tl.minimum(begin + seg_len, length)
        if length <= k:
            for start in range(begin, end, BLOCK):
                o_k = start + tl.arange(0, BLOCK)
                tl.store(p_out + o_k, o_k, mask=o_k < end)
        else:
            prefix, need = _fixed_digits(hist + i_r * ((32 // DIGIT) * BINS), k, 32 // DIGIT,
                                         DIGIT, BINS)
            threshold = prefix ^ INT32_MIN
            num_gt, num_eq = _before(counts + i_r.to(tl.int64) * stride_c, i_s, BLOCK)
            p_row = scores + i_r.to(tl.int64) * stride_s
            for start in range(begin, end, BLOCK):
                o_k = start + tl.arange(0, BLOCK)
                m_k = o_k < end
                b_key = _order_keys(p_row + o_k, m_k)
                m_gt = m_k & (b_key > threshold)
                m_eq = m_k & (b_key == threshold)
                r_gt = num_gt + tl.cumsum(m_gt.to(tl.int32), 0) - 1
                r_eq = num_eq + tl.cumsum(m_eq.to(tl.int32), 0) - 1
                tl.store(p_out + r_gt, o_k, mask=m_gt)
                tl.store(p_out + (k - need) + r_eq, o_k, mask=m_eq & (r_eq < need))
                num_gt += tl.sum(m_gt.to(tl.int32), 0)
                num_eq += tl.sum(m_eq.to(tl.int32), 0)


def topk_indices(scores: torch.Tensor, lengths: torch.Tensor, k: int, *,
                 config: TopkConfig | None = None) -> torch.Tensor:
    """Indices `[R, k]` int32 of the k largest of `scores[r, :lengths[r]]` (ties to the lower
    index), -1 where a row has fewer than k. scores `[R, W]` fp32 with unit column stride,
    lengths `[R]` int32 (each at most W) on the scores' device. `config`: the launch
    (default: DEFAULT_RULE's pick for R x W)."""
    num_rows, width = scores.shape
    config = config or DEFAULT_RULE.pick(num_rows, width)
    assert scores.dtype == torch.float32 and scores.stride(1) == 1
    assert lengths.shape == (num_rows,) and lengths.dtype == torch.int32
    assert k >= 1 and config.block & (config.block - 1) == 0
    assert config.min_segment % config.block == 0
    out = torch.empty(num_rows, k, dtype=torch.int32, device=scores.device)
    if num_rows == 0:
        return out
    seg_len = config.segment(num_rows, width, scores.device)
    grid = (num_rows, triton.cdiv(max(width, 1), seg_len))
    hist = torch.zeros(num_rows, config.passes, config.bins, dtype=torch.int32,
                       device=scores.device)
    seg_hist = torch.empty(num_rows, grid[1], config.passes, config.bins, dtype=torch.int32,
                           device=scores.device)
    counts = torch.empty(num_rows, grid[1], 2, dtype=torch.int32, device=scores.device)
    digits = dict(DIGIT=config.digit_bits, BINS=config.bins, num_warps=config.num_warps)
    common = dict(digits, BLOCK=config.block)
    for p in range(config.passes):
        topk_histogram_kernel[grid](scores, lengths, hist, seg_hist, k, seg_len,
                                    scores.stride(0), seg_hist.stride(0), PASS=p, **common)
    topk_count_kernel[grid](lengths, hist, seg_hist, counts, k, seg_len, seg_hist.stride(0),
                            counts.stride(0), **digits)
    topk_write_kernel[grid](scores, lengths, hist, counts, out, k, seg_len, scores.stride(0),
                            counts.stride(0), out.stride(0), **common)
    return out


__all__ = ["DEFAULT_CONFIG", "DEFAULT_RULE", "LONG_ROWS_CONFIG", "TopkConfig", "TopkRule",
           "topk_indices"]
