"""Triton mHC pre and post (spec/model.md §2.2; ref.py is the spec, README.md the launch shapes).

hyper_pre, one launch: a program owns a block of tokens and one range of the flattened streams
`[T, S*D]`. It accumulates the projection onto fn's rows and the sum of squares in fp32 (the RMS
norm scales a whole row, so it is applied after the product), and writes both to a scratch
buffer. The range that arrives last at its token block's counter adds the ranges (a fixed order,
loading many ranges' partials at once), forms
the weights (gates, softmax, Sinkhorn in registers), writes post and comb, and collapses the
block's streams with the pre weights.
hyper_post, one launch: a program per (token, feature block); products and sum in fp32, one
rounding to the streams' dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fused_moe.expert_rows import ExpertRows, routed_sum
from glmflash.kernels.triton_utils import ArrivalCounters, interpreting, jit, num_sms

# Per-device arrival counters of the split reduction, one per token block; every launch leaves
# them at zero. Allocated once and never replaced, so CUDA graphs that captured a launch stay
# valid. Ranges are split only while token blocks are few, so this many is plenty.
_ARRIVALS = ArrivalCounters(1 << 12)
# Up to these many tokens hyper_pre's default launch takes a block per token, then the
# few-token (decode) shape.
FEW_TOKENS = 8
DECODE_TOKENS = 64


@dataclass(frozen=True)
class HyperPreConfig:
    """Launch shape of hyper_pre_kernel; `default_pre_config` picks one per token count."""

    block_t: int  # tokens per program; from 16 the projection runs on tensor cores, below by FMA
    block_k: int  # columns of the flattened streams per projection step
    block_d: int  # features per collapse step
    waves: float = 2.0  # programs per SM that splitting the S*D reduction into ranges aims for
    min_range_steps: int = 2  # projection steps per range at least
    splits: int | None = None  # a fixed number of ranges instead (tests, sweeps)
    num_warps: int = 4
    partial_values: int = 2048  # fp32 partials the finish loads at once (16 regs at 4 warps)
    prefetch_streams: bool = True  # the finish loads its first chunk of streams up front

    def __post_init__(self) -> None:
        for size in (self.block_t, self.block_k, self.block_d):
            assert size >= 1 and size & (size - 1) == 0, f"block sizes are powers of two: {self}"
        assert self.block_k >= 16 or self.block_t < 16, "tensor-core steps need block_k >= 16"
        assert self.partial_values >= 1 and self.partial_values & (self.partial_values - 1) == 0, (
            f"partial_values is a power of two: {self}")


@dataclass(frozen=True)
class HyperPostConfig:
    """Launch shape of hyper_post_kernel: one token and `block_d` features per program."""

    block_d: int = 1024
    num_warps: int = 4

    def __post_init__(self) -> None:
        assert self.block_d >= 16 and self.block_d & (self.block_d - 1) == 0



@jit
def _project_dot(x, fn, o_t, m_t, k_begin, k_end, stride_x, stride_fn, N: tl.constexpr,
                 NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr):
    """(x[tokens, range] fn[:, range]^T, sum of x[tokens, range]^2) on tensor cores, fp32."""
    o_k = tl.arange(0, BK)
    o_n = tl.arange(0, NP)
    p_x = x + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :]
    p_fn = fn + o_n[:, None] * stride_fn + o_k[None, :]
    b_acc = tl.zeros([BT, NP], dtype=tl.float32)
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        m_k = k0 + o_k < k_end
        b_x = tl.load(p_x + k0, mask=m_t[:, None] & m_k[None, :], other=0.0)  # [BT, BK]
        b_fn = tl.load(p_fn + k0, mask=(o_n < N)[:, None] & m_k[None, :], other=0.0)  # [NP, BK]
        b_xf = b_x.to(tl.float32)
        b_ss += tl.sum(b_xf * b_xf, 1)
        b_acc = tl.dot(b_x.to(DOT), tl.trans(b_fn.to(DOT)), b_acc, input_precision=PREC)
    return b_acc, b_ss


@jit
def _project_fma(x, fn, o_t, m_t, k_begin, k_end, stride_x, stride_fn, N: tl.constexpr,
                 NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    """As _project_dot by fp32 FMA into a [BT, NP, BK] tile reduced once (few tokens)."""
    o_k = tl.arange(0, BK)
    o_n = tl.arange(0, NP)
    p_x = x + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :]
    p_fn = fn + o_n[:, None] * stride_fn + o_k[None, :]
    b_acc = tl.zeros([BT, NP, BK], dtype=tl.float32)
    b_ss = tl.zeros([BT, BK], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BK):
        m_k = k0 + o_k < k_end
        b_x = tl.load(p_x + k0, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_fn = tl.load(p_fn + k0, mask=(o_n < N)[:, None] & m_k[None, :], other=0.0)
        b_ss += b_x * b_x
        b_acc += b_x[:, None, :] * b_fn.to(tl.float32)[None, :, :]
    return tl.sum(b_acc, 2), tl.sum(b_ss, 1)


@jit
def _sinkhorn(b_c, eps, ITERS: tl.constexpr):
    """[BT, S, S]: divide columns by (sum + eps), then ITERS - 1 times rows, then columns."""
    b_c = b_c / (tl.sum(b_c, 1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        b_c = b_c / (tl.sum(b_c, 2)[:, :, None] + eps)
        b_c = b_c / (tl.sum(b_c, 1)[:, None, :] + eps)
    return b_c


@jit
def _weights(p_tot, base, scale, post, comb, o_t, m_t, K, norm_eps, hc_eps, S: tl.constexpr,
             ITERS: tl.constexpr, NP: tl.constexpr, BT: tl.constexpr):
    """From a token block's summed projections (row r at p_tot + r * NP, the sum of squares in
    column (2 + S) * S): write post and comb, return the pre weights [BT, S]."""
    o_r = tl.arange(0, BT)
    o_s = tl.arange(0, S)
    o_ij = o_s[:, None] * S + o_s[None, :]  # [S, S]
    p_row = p_tot + o_r[:, None] * NP  # [BT, 1]
    b_ss = tl.load(p_tot + o_r * NP + (2 + S) * S, cache_modifier=".cg")
    b_rstd = tl.rsqrt(b_ss / K + norm_eps)[:, None]  # [BT, 1]
    b_pre = tl.load(p_row + o_s[None, :], cache_modifier=".cg") * b_rstd  # [BT, S]
    b_pre = tl.sigmoid(b_pre * tl.load(scale) + tl.load(base + o_s)[None, :]) + hc_eps
    b_post = tl.load(p_row + S + o_s[None, :], cache_modifier=".cg") * b_rstd
    b_post = 2 * tl.sigmoid(b_post * tl.load(scale + 1) + tl.load(base + S + o_s)[None, :])
    b_l = tl.load(p_row[:, :, None] + 2 * S + o_ij[None, :, :], cache_modifier=".cg")
    b_l = b_l * b_rstd[:, :, None] * tl.load(scale + 2) + tl.load(base + 2 * S + o_ij)[None, :, :]
    b_e = tl.exp(b_l - tl.max(b_l, 2)[:, :, None])  # [BT, S, S]
    b_c = _sinkhorn(b_e / tl.sum(b_e, 2)[:, :, None] + hc_eps, hc_eps, ITERS)
    o_t64 = o_t.to(tl.int64)
    tl.store(post + o_t64[:, None] * S + o_s[None, :], b_post, mask=m_t[:, None])
    tl.store(comb + o_t64[:, None, None] * (S * S) + o_ij[None, :, :], b_c,
             mask=m_t[:, None, None])
    return b_pre


@jit
def _stream_chunk(x, o_t, m_t, d0, D, S: tl.constexpr, BD: tl.constexpr):
    """Features [d0, d0 + BD) of the token block's streams, `[BT, S, BD]`."""
    o_s = tl.arange(0, S)
    o_d = d0 + tl.arange(0, BD)
    rows = o_t.to(tl.int64)[:, None, None] * (S * D) + o_s[None, :, None] * D
    return tl.load(x + rows + o_d[None, None, :],
                   mask=m_t[:, None, None] & (o_d < D)[None, None, :], other=0.0)


@jit
def _collapse(x, out, b_pre, b_first, norm_w, rms_eps, o_t, m_t, D, S: tl.constexpr,
              BD: tl.constexpr, NORM: tl.constexpr):
    """out[t, :] = sum_s pre[t, s] x[t, s, :] in fp32, rounded once; b_pre [BT, S]; b_first
    the first chunk of the streams (`_stream_chunk` at 0), the rest loaded here. With NORM the
    rows are then RMS-normalised in place (`_normalise`)."""
    b_sq = _collapse_chunk(out, b_pre, b_first, o_t, m_t, 0, D, BD)
    for d0 in range(BD, D, BD):
        b_sq += _collapse_chunk(out, b_pre, _stream_chunk(x, o_t, m_t, d0, D, S, BD), o_t, m_t,
                                d0, D, BD)
    if NORM:
        # Every thread's rounded values are written before any thread reads its chunk back.
        tl.debug_barrier()
        b_rstd = tl.rsqrt(b_sq / D + rms_eps)
        for d0 in range(0, D, BD):
            _normalise(out, norm_w, b_rstd, o_t, m_t, d0, D, BD)


@jit
def _collapse_chunk(out, b_pre, b_x, o_t, m_t, d0, D, BD: tl.constexpr):
    """One chunk of the collapse, stored rounded; returns each row's sum of squares of the
    rounded values over the chunk `[BT]` (what an RMSNorm of the stored rows sums)."""
    o_d = d0 + tl.arange(0, BD)
    b_o = tl.sum(b_x.to(tl.float32) * b_pre[:, :, None], 1).to(out.dtype.element_ty)  # [BT, BD]
    tl.store(out + o_t.to(tl.int64)[:, None] * D + o_d[None, :], b_o,
             mask=m_t[:, None] & (o_d < D)[None, :])
    b_r = b_o.to(tl.float32)
    return tl.sum(b_r * b_r, 1)


@jit
def _normalise(out, norm_w, b_rstd, o_t, m_t, d0, D, BD: tl.constexpr):
    """RMSNorm of one chunk of the stored rows as the reference rounds it (`rms_norm_ref`):
    x * rstd rounded to the model dtype, then times the weight, rounded again."""
    o_d = d0 + tl.arange(0, BD)
    m = m_t[:, None] & (o_d < D)[None, :]
    p_o = out + o_t.to(tl.int64)[:, None] * D + o_d[None, :]
    dt = out.dtype.element_ty
    b_y = (tl.load(p_o, mask=m, other=0.0).to(tl.float32) * b_rstd[:, None]).to(dt)
    b_w = tl.load(norm_w + o_d, mask=o_d < D, other=0.0).to(tl.float32)
    tl.store(p_o, (b_w[None, :] * b_y.to(tl.float32)).to(dt), mask=m)


@jit
def hyper_pre_kernel(x, fn, base, scale, post, comb, out, part, arrivals, norm_w, T, D,
                     stride_fn, K_PER_SPLIT, SPLITS, norm_eps, hc_eps, rms_eps, S: tl.constexpr,
                     ITERS: tl.constexpr,
                     NP: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
                     USE_DOT: tl.constexpr, USE_SPLIT: tl.constexpr, RB: tl.constexpr,
                     DOT: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr,
                     NORM: tl.constexpr):
    """mHC pre for tokens [i_t * BT, +BT), columns [i_s * K_PER_SPLIT, +K_PER_SPLIT) of the
    flattened streams; the last range of the token block finishes it (see the module doc).
    PREFETCH: the finishing program loads the collapse's first chunk of streams before the
    ranges' partials, so that its latency runs under theirs and the weights'. NORM: the
    collapsed rows are RMS-normalised with `norm_w` (the sub-layer's input norm)."""
    i_t, i_s = tl.program_id(0), tl.program_id(1)
    N: tl.constexpr = (2 + S) * S
    K = S * D
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    k_begin = i_s * K_PER_SPLIT
    k_end = tl.minimum(k_begin + K_PER_SPLIT, K)
    if USE_DOT:
        b_acc, b_ss = _project_dot(x, fn, o_t, m_t, k_begin, k_end, K, stride_fn, N, NP, BT, BK,
                                   DOT, PREC)
    else:
        b_acc, b_ss = _project_fma(x, fn, o_t, m_t, k_begin, k_end, K, stride_fn, N, NP, BT, BK)
    o_n = tl.arange(0, NP)
    # NOTE: fn rows N.. are masked to zero, so column N is free for the sum of squares.
    b_acc = tl.where(o_n[None, :] == N, b_ss[:, None], b_acc)  # [BT, NP]
    o_tile = tl.arange(0, BT)[:, None] * NP + o_n[None, :]
    p_tile = part + (i_t * SPLITS).to(tl.int64) * (BT * NP)
    tl.store(p_tile + i_s * (BT * NP) + o_tile, b_acc)
    # Every warp's partial is written before the release, and before the reloads below.
    tl.debug_barrier()
    is_last = True
    if USE_SPLIT:
        is_last = tl.atomic_add(arrivals + i_t, 1, sem="acq_rel") == SPLITS - 1
    if is_last:
        if PREFETCH:
            b_first = _stream_chunk(x, o_t, m_t, 0, D, S, BD)
        if USE_SPLIT:
            tl.debug_barrier()
            # The ranges' partials, RB at a time: one round of independent loads per chunk (a
            # loop of single partials would wait out an L2 round trip for each).
            o_rb = tl.arange(0, RB)
            b_tot = tl.zeros([BT, NP], dtype=tl.float32)
            for r0 in range(0, SPLITS, RB):
                m_r = (r0 + o_rb < SPLITS)[:, None, None]
                p_ranges = p_tile + (r0 + o_rb)[:, None, None] * (BT * NP) + o_tile[None, :, :]
                b_tot += tl.sum(tl.load(p_ranges, mask=m_r, other=0.0, cache_modifier=".cg"), 0)
            tl.store(p_tile + o_tile, b_tot)
            tl.atomic_xchg(arrivals + i_t, 0, sem="relaxed")
            tl.debug_barrier()
        b_pre = _weights(p_tile, base, scale, post, comb, o_t, m_t, K, norm_eps, hc_eps, S,
                         ITERS, NP, BT)
        if not PREFETCH:
            b_first = _stream_chunk(x, o_t, m_t, 0, D, S, BD)
        _collapse(x, out, b_pre, b_first, norm_w, rms_eps, o_t, m_t, D, S, BD, NORM)


@jit
def hyper_post_kernel(y, y2, x, post, comb, out, ids, weights, num_experts, D, stride_y,
                      stride_y2, S: tl.constexpr, BD: tl.constexpr, TWO: tl.constexpr,
                      TOP_K: tl.constexpr):
    """out[t, j, d] = post[t, j] y[t, d] + sum_i comb[t, i, j] x[t, i, d], features
    [i_d * BD, +BD); the weights rounded to the streams' dtype first, as the reference does.
    With TWO the block output is y + y2 rounded to the streams' dtype (a MoE's routed and shared
    parts, added as the reference adds them). With TOP_K > 0, y holds the routed experts' rows
    before their sum (`ExpertRows`), summed here as their own launch would (`routed_sum`)."""
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_s = tl.arange(0, S)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    dt = out.dtype.element_ty
    if TOP_K > 0:
        b_y = routed_sum(y, ids, weights, i_t, o_d, m_d, num_experts, stride_y, TOP_K)
        b_y = b_y.to(dt).to(tl.float32)
    else:
        b_y = tl.load(y + i_t * stride_y + o_d, mask=m_d, other=0.0).to(tl.float32)
    if TWO:
        b_y2 = tl.load(y2 + i_t * stride_y2 + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_y = (b_y + b_y2).to(dt).to(tl.float32)
    b_post = tl.load(post + i_t * S + o_s).to(dt).to(tl.float32)  # [S]
    b_acc = b_post[:, None] * b_y[None, :]  # [S, BD]
    p_x = x + i_t * (S * D) + o_d
    for i in tl.static_range(S):
        b_x = tl.load(p_x + i * D, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        b_c = tl.load(comb + (i_t * S + i) * S + o_s).to(dt).to(tl.float32)  # comb[t, i, :]
        b_acc += b_c[:, None] * b_x[None, :]
    p_o = out + i_t * (S * D) + o_s[:, None] * D + o_d[None, :]
    tl.store(p_o, b_acc.to(dt), mask=m_d[None, :])


def default_pre_config(num_tokens: int, num_streams: int, num_sms: int,
                       fp32_products: bool = False) -> HyperPreConfig:
    """Up to 8 tokens: a block per token by FMA, so that each token's finish (reduction,
    weights, collapse) runs in its own program, with a [1, NP, 128] product tile and collapse
    tiles [1, S, BD] of 8K values (README.md, Measurements). Up to 64: blocks of 4 (a
    [BT, NP, BK] product tile of 8K values). Many:
    16-64-token blocks on tensor cores, about one per SM, 64 columns a step (16 with fp32
    operands, whose products need far more registers). Collapse tiles of 4K values there."""
    if num_tokens <= FEW_TOKENS:
        return HyperPreConfig(block_t=1, block_k=128,
                              block_d=max(16, 8192 // num_streams))
    if num_tokens <= DECODE_TOKENS:
        return HyperPreConfig(block_t=4, block_k=64, block_d=max(16, 4096 // (4 * num_streams)))
    bt = min(64, max(16, triton.next_power_of_2(triton.cdiv(num_tokens, num_sms))))
    return HyperPreConfig(block_t=bt, block_k=16 if fp32_products else 64,
                          block_d=max(16, 4096 // (bt * num_streams)),
                          waves=1.0)


def default_post_config(num_tokens: int) -> HyperPostConfig:
    """Narrow feature blocks while tokens are few, so that enough programs run (up to 8
    tokens, 128 features and 8 warps: README.md, Measurements)."""
    if num_tokens <= FEW_TOKENS:
        return HyperPostConfig(block_d=128, num_warps=8)
    return HyperPostConfig(block_d=256 if num_tokens <= DECODE_TOKENS else 1024)


def range_block(splits: int, block_t: int, np_: int, partial_values: int = 2048) -> int:
    """Ranges whose partials the finishing program loads at once."""
    return min(triton.next_power_of_2(splits), max(1, partial_values // (block_t * np_)))


def _num_splits(config: HyperPreConfig, tiles: int, k: int, device: torch.device) -> int:
    """Ranges of the S*D reduction: a fixed number, or enough for `waves` programs per SM."""
    steps = triton.cdiv(k, config.block_k)
    if config.splits is not None:
        return max(1, min(config.splits, steps))
    want = triton.cdiv(int(num_sms(device) * config.waves), tiles)
    return max(1, min(want, steps // config.min_range_steps))


def _dot_type(streams: torch.Tensor, fn: torch.Tensor) -> tuple:
    """Tensor-core operand type: the model's 16-bit type when streams and fn share it (products
    exact in fp32), else fp32 with exact products (also under the interpreter)."""
    half = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    if streams.dtype == fn.dtype and streams.dtype in half and not interpreting():
        return half[streams.dtype], "tf32"
    return tl.float32, "ieee"


def _check_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor,
               scale: torch.Tensor) -> None:
    assert streams.dim() == 3 and streams.is_contiguous(), "streams must be contiguous [T, S, D]"
    _, s, d = streams.shape
    assert s & (s - 1) == 0, f"the stream count must be a power of two, got {s}"
    assert fn.shape == ((2 + s) * s, s * d) and fn.stride(1) == 1, (
        f"fn must be [(2+S)*S, S*D] = {((2 + s) * s, s * d)} with unit column stride, "
        f"got {tuple(fn.shape)} / {fn.stride()}")
    assert base.shape == ((2 + s) * s,) and base.is_contiguous()
    assert scale.shape == (3,) and scale.is_contiguous()
    devices = {t.device for t in (streams, fn, base, scale)}
    assert len(devices) == 1, f"all tensors on one device, got {devices}"


def hyper_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
              *, norm_eps: float, hc_eps: float, sinkhorn_iters: int,
              norm: tuple[torch.Tensor, float] | None = None,
              config: HyperPreConfig | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `hyper_pre_ref`: (post `[T, S]` fp32, comb `[T, S, S]` fp32, collapsed `[T, D]`);
    with `norm` = (weight `[D]` in the streams' dtype, eps) the collapsed rows come out
    RMS-normalised (`rms_norm_ref`), as the sub-layer reads them.

    One launch, no host sync. Launches on one device must run in stream order (they share the
    arrival counters)."""
    _check_pre(streams, fn, base, scale)
    assert sinkhorn_iters >= 1
    if norm is not None:
        assert norm[0].shape == (streams.shape[2],) and norm[0].is_contiguous()
        assert norm[0].dtype == streams.dtype, "the norm's weight product rounds in that dtype"
    num_tokens, s, d = streams.shape
    dev = streams.device
    post = torch.empty(num_tokens, s, dtype=torch.float32, device=dev)
    comb = torch.empty(num_tokens, s, s, dtype=torch.float32, device=dev)
    out = torch.empty(num_tokens, d, dtype=streams.dtype, device=dev)
    if num_tokens == 0:
        return post, comb, out
    dot, prec = _dot_type(streams, fn)
    cfg = config or default_pre_config(num_tokens, s, num_sms(dev), dot == tl.float32)
    tiles = triton.cdiv(num_tokens, cfg.block_t)
    splits = _num_splits(cfg, tiles, s * d, dev)
    arrivals = _ARRIVALS.get(dev, tiles) if splits > 1 else None
    if arrivals is None:
        splits = 1
    k_per_split = triton.cdiv(triton.cdiv(s * d, splits), cfg.block_k) * cfg.block_k
    splits = triton.cdiv(s * d, k_per_split)
    np_ = max(16, triton.next_power_of_2((2 + s) * s + 1))
    part = torch.empty(tiles * splits * cfg.block_t * np_, dtype=torch.float32, device=dev)
    hyper_pre_kernel[(tiles, splits)](
        streams, fn, base, scale, post, comb, out, part, arrivals if splits > 1 else part,
        out if norm is None else norm[0], num_tokens, d, fn.stride(0), k_per_split, splits,
        norm_eps, hc_eps, 0.0 if norm is None else norm[1], S=s,
        ITERS=sinkhorn_iters, NP=np_, BT=cfg.block_t, BK=cfg.block_k, BD=cfg.block_d,
        USE_DOT=cfg.block_t >= 16, USE_SPLIT=splits > 1,
        RB=range_block(splits, cfg.block_t, np_, cfg.partial_values), DOT=dot, PREC=prec,
        PREFETCH=cfg.prefetch_streams, NORM=norm is not None, num_warps=cfg.num_warps)
    return post, comb, out


def hyper_post(block_out: torch.Tensor | ExpertRows, streams: torch.Tensor, post: torch.Tensor,
               comb: torch.Tensor, *, extra: torch.Tensor | None = None,
               config: HyperPostConfig | None = None) -> torch.Tensor:
    """Triton `hyper_post_ref`: block_out `[T, D]`, streams `[T, S, D]`, post `[T, S]`, comb
    `[T, S, S]` -> `[T, S, D]` in the streams' dtype. `extra` `[T, D]`: a second block output
    added first (`block_out + extra`, rounded as torch rounds it). block_out may be routed
    experts' rows before their sum (`ExpertRows`): the sum is formed here, with the bits of
    its own launch. One launch, no host sync."""
    assert streams.dim() == 3 and streams.is_contiguous(), "streams must be contiguous [T, S, D]"
    num_tokens, s, d = streams.shape
    assert s & (s - 1) == 0, f"the stream count must be a power of two, got {s}"
    routed = block_out if isinstance(block_out, ExpertRows) else None
    if routed is not None and routed.ids.shape[1] == 0:
        block_out, routed = routed.summed(), None  # no experts: zeros
    if routed is not None:
        assert routed.num_tokens == num_tokens and routed.ids.is_contiguous()
        block_out = routed.rows
    outputs = [(block_out, num_tokens * (1 if routed is None else routed.ids.shape[1]))]
    for y, rows in outputs + ([] if extra is None else [(extra, num_tokens)]):
        assert y.shape == (rows, d) and y.stride(1) == 1
        assert y.dtype == streams.dtype, "block outputs and streams share the model dtype"
    assert post.shape == (num_tokens, s) and post.is_contiguous()
    assert comb.shape == (num_tokens, s, s) and comb.is_contiguous()
    out = torch.empty_like(streams)
    if num_tokens == 0:
        return out
    cfg = config or default_post_config(num_tokens)
    y2 = block_out if extra is None else extra
    ids, weights = (post, post) if routed is None else (routed.ids, routed.weights)
    hyper_post_kernel[(num_tokens, triton.cdiv(d, cfg.block_d))](
        block_out, y2, streams, post, comb, out, ids, weights,
        0 if routed is None else routed.num_experts, d, block_out.stride(0), y2.stride(0), S=s,
        BD=cfg.block_d, TWO=extra is not None,
        TOP_K=0 if routed is None else routed.ids.shape[1], num_warps=cfg.num_warps)
    return out


__all__ = ["HyperPostConfig", "HyperPreConfig", "default_post_config", "default_pre_config",
           "hyper_post", "hyper_pre"]
