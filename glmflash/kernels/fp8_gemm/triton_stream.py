"""Block-FP8 linear for a few rows (2..63): W8A8 with the weight streamed straight into the
tensor cores, split over K so that every SM streams.

The products are swapped (`y^T = W x^T`): weight rows fill the product's M dimension (64 per
program) and the few activation rows sit in its narrow N dimension, so the FP8 weight tile goes
from memory through shared memory into the product unconverted. Each program quantises its
activation rows per 128-channel block in registers (the quantiser of the prefill path), and
applies `x scale * w scale` to each block's fp32 partial (one FMA per accumulator element).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import (
    plan_splits,
    quantize_rows,
    split_buffer,
    store_split,
)
from glmflash.kernels.triton_utils import jit


@dataclass(frozen=True)
class StreamConfig:
    """Launch shape of the weight-streaming W8A8 GEMM."""

    block_n: int = 64
    """Weight rows per program (the product's M: 64 is one warpgroup's wgmma)."""
    waves: float = 4.0
    """K is split until about this many programs per SM stream the weight."""
    min_split_blocks: int = 2
    """Scale blocks per K range at least."""
    num_warps: int = 4
    num_stages: int = 4
    finish_registers: int = 64
    """fp32 registers a thread of the last K range may fill with partials per L2 round trip:
    the finish loads 8 ranges' partials at once when they fit, 4 otherwise
    (`triton_common.store_split`; the sum's order, hence its bits, is the same)."""

    def finish_group(self, rows: int, cols: int) -> int:
        """Partials loaded per round trip for a [rows, cols] tile."""
        per_partial = rows * cols // (32 * self.num_warps)
        return 8 if 8 * per_partial <= self.finish_registers else 4


STREAM_CONFIG = StreamConfig()


@dataclass(frozen=True)
class StreamRule:
    """Launch shapes by weight shape: the first entry whose limits the weight fits (K at most
    `max_k`, N at most `max_n`, K at least `min_k`) gives its config; `default` otherwise.
    Also the one-row FMA kernel's rule (triton_impl.py), whose launch takes a StreamConfig's
    columns, waves, split blocks, warps and stages."""

    entries: tuple[tuple[int, int, int, StreamConfig], ...] = ()
    """(min_k, max_k, max_n, config)."""
    default: StreamConfig = STREAM_CONFIG
    capability: tuple[int, int] | None = None
    """The GPU the rule was measured on; elsewhere `pick_for` returns the fallback shape.
    None: every GPU."""

    def pick(self, n: int, k: int) -> StreamConfig:
        for min_k, max_k, max_n, config in self.entries:
            if min_k <= k <= max_k and n <= max_n:
                return config
        return self.default

    def pick_for(self, n: int, k: int, device: torch.device,
                 fallback: StreamConfig = STREAM_CONFIG) -> StreamConfig:
        """`pick` on the rule's GPU, `fallback` on others."""
        if self.capability is not None and \
                torch.cuda.get_device_capability(device) != self.capability:
            return fallback
        return self.pick(n, k)


_ANY = 1 << 30
# The H200's rule (bench/sweeps.py --ops fp8rules at 16 rows; README.md has the figures): small
# N splits K more, 4096x4096 takes 128-row tiles, long K with N 4096 two waves and 6 stages,
# wide N one wave and 6 stages. SM90 only: the 6-stage and 128-row shapes need more than the
# 99 KB of shared memory of sm_89 / sm_120 at 33-63 rows.
H200_STREAM_RULE = StreamRule(
    entries=((0, _ANY, 2048, StreamConfig(waves=4.0, min_split_blocks=4)),
             (0, 4096, 4096, StreamConfig(block_n=128, waves=2.0, num_warps=8)),
             (0, _ANY, 4096, StreamConfig(waves=2.0, num_stages=6))),
    default=StreamConfig(waves=1.0, num_stages=6),
    capability=(9, 0))


# The H200's rule for the one-row FMA kernel (bench/sweeps.py --ops fp8row; README.md): N up to
# 4096 splits K into twice as many ranges (eight programs per SM), with 64 columns a program
# when K is long; wider N keeps 32 columns and four programs per SM.
H200_ONE_ROW_RULE = StreamRule(
    entries=((4097, _ANY, 4096, StreamConfig(block_n=64, waves=8.0)),
             (0, _ANY, 4096, StreamConfig(block_n=32, waves=8.0))),
    default=StreamConfig(block_n=32, waves=4.0),
    capability=(9, 0))


# The H200's rule for the weight-only kernel on fp16 codes, 2-32 rows (bench/sweeps.py --ops
# fp8codes; README.md, "A few rows on fp16 codes"): the fastest of 64 / 128 columns x 2 / 4 / 8
# waves summed over 2, 8, 16 and 32 rows at each release shape. K up to 4096 with N up to 2048
# or above 4096 splits K into half as many ranges; short K (up to 2048) with N above 4096 is not
# split at all (one wave: 256 column tiles at 1536->16384, from --ops fp8codes_grid at 16 rows);
# the rest keeps the `wdq_*` fields' shape.
H200_CODES_RULE = StreamRule(
    entries=((0, _ANY, 2048, StreamConfig(block_n=64, waves=2.0)),
             (0, 4096, 4096, StreamConfig(block_n=64, waves=4.0)),
             (0, 2048, _ANY, StreamConfig(block_n=64, waves=1.0)),
             (0, 4096, _ANY, StreamConfig(block_n=64, waves=2.0))),
    default=StreamConfig(block_n=64, waves=4.0),
    capability=(9, 0))


@jit
def fp8_stream_gemm_kernel(x, w, ws, y, part, arrivals, M, N, K, stride_xm, stride_wn,
                           stride_wsn, stride_ym, K_PER_SPLIT, SPLITS, BLOCK: tl.constexpr,
                           BN: tl.constexpr, BM: tl.constexpr, GROUP: tl.constexpr):
    """y[rows, cols]^T = sum over the K blocks of one range of (W_kb xq_kb^T) * ws[col block, kb]
    * xs[row, kb]: weight rows as the product's M, activation rows (quantised here per block)
    as its N."""
    i_n, i_m, i_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_n = i_n * BN + tl.arange(0, BN)
    o_m = i_m * BM + tl.arange(0, BM)
    o_k = tl.arange(0, BLOCK)
    m_n, m_m = o_n < N, o_m < M
    # NOTE: BN divides BLOCK, so one weight-scale row per program; the scale is loaded as a
    # [BM] vector (every lane the same address): a scalar scale load in a pipelined loop is a
    # known miscompile (spec/kernels.md §4).
    p_ws = ws + ((i_n * BN) // BLOCK) * stride_wsn + o_m * 0
    p_w = w + o_n[:, None].to(tl.int64) * stride_wn + o_k[None, :]
    p_x = x + o_m[:, None].to(tl.int64) * stride_xm + o_k[None, :]
    k_begin = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    b_acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK):
        m_k = k0 + o_k < K
        b_x = tl.load(p_x + k0, mask=m_m[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_xq, b_xs = quantize_rows(b_x, w.dtype.element_ty)  # [BM, BLOCK], [BM]
        b_w = tl.load(p_w + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)  # [BN, BLOCK]
        b_ws = tl.load(p_ws + k0 // BLOCK)  # [BM]
        b_acc += tl.dot(b_w, tl.trans(b_xq)) * (b_xs * b_ws)[None, :]
    o_y = o_m[None, :].to(tl.int64) * stride_ym + o_n[:, None]
    store_split(b_acc, y, o_y, m_n[:, None] & m_m[None, :], part, arrivals,
                i_m * tl.num_programs(0) + i_n, i_s, SPLITS, BN, BM, GROUP)


def fp8_linear_stream(x2: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                      block: int, config: StreamConfig = STREAM_CONFIG) -> torch.Tensor:
    """[M, K] x block-FP8 [N, K] -> [M, N] in x's dtype, W8A8 (activations quantised per row
    and `block` channels). Launches on one device must run in stream order (they share the
    split-K counters)."""
    m, k = x2.shape
    n = weight.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    assert bm <= 64, f"{m} rows: the streaming form is for fewer than 64"
    bn = min(config.block_n, block)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    splits, k_per_split, arrivals = plan_splits(x2.device, tiles, k, block, config.waves,
                                                config.min_split_blocks)
    out = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    part = split_buffer(splits, tiles, bm * bn, out)
    fp8_stream_gemm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x2, weight, scale_inv, out, part, out if arrivals is None else arrivals, m, n, k,
        x2.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0), k_per_split, splits,
        BLOCK=block, BN=bn, BM=bm, GROUP=config.finish_group(bn, bm), num_warps=config.num_warps,
        num_stages=config.num_stages)
    return out


__all__ = ["H200_CODES_RULE", "H200_ONE_ROW_RULE", "H200_STREAM_RULE", "STREAM_CONFIG",
           "StreamConfig", "StreamRule", "fp8_linear_stream", "fp8_stream_gemm_kernel"]
