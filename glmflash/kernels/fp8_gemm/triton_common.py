"""What the block-FP8 Triton kernels share: per-row activation quantisation of a register tile,
and the split-K finish over arrival counters (each K range stores its fp32 partial; the range
that arrives last sums them in range order and writes the output, so one launch, no zeroed
buffer and the same bits on every call)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import ArrivalCounters, constexpr, interpreting, jit, num_sms

FP8_MAX = constexpr(448.0)
# Per-device arrival counters of the split-K reductions: one per output tile; every launch
# leaves them at zero. Allocated once and never replaced, so CUDA graphs that captured a launch
# stay valid. Launches sharing them must run in stream order.
ARRIVALS = ArrivalCounters(1 << 16)


def has_fp8_products(device: torch.device) -> bool:
    """Whether `tl.dot` takes e4m3 operands here: SM89 (Ada) and later, and the interpreter."""
    if device.type != "cuda":
        return interpreting()
    return torch.cuda.get_device_capability(device) >= (8, 9)


# NOTE: Triton's interpreter converts fp32 to e4m3 wrongly when rounding carries into the
# exponent (125.06 -> 64, not 128) and truncates subnormals; under it the quantiser first rounds
# to the e4m3 grid in fp32 (which it then converts exactly), so that interpreter runs match
# the GPU's round-to-nearest-even.
ROUND_BEFORE_CONVERT = constexpr(interpreting())


@jit
def _round_to_e4m3(b_v):
    """fp32 values within +-448 rounded to nearest e4m3 value, ties to even: 4 significant bits
    by Veltkamp's split (x * (2^20 + 1)), subnormals (below 2^-6) to multiples of 2^-9."""
    b_t = b_v * 1048577.0
    b_normal = b_t - (b_t - b_v)
    b_sub = (b_v + 24576.0) - 24576.0
    return tl.where(tl.abs(b_v) < 0.015625, b_sub, b_normal)


@jit
def quantize_rows(b_x, FP8: tl.constexpr, b_amax=None):
    """A [R, C] fp32 tile -> (e4m3 codes [R, C], fp32 scales [R]): per row, scale = amax / 448
    (at least 1e-12 / 448) and code = x / scale rounded to nearest, as DeepSeek's activation
    quantiser. `b_amax` `[R]`: the rows' largest magnitudes when the tile is part of wider
    rows (default: the tile's own)."""
    if b_amax is None:
        b_amax = tl.max(tl.abs(b_x), 1)
    b_s = tl.maximum(b_amax, 1e-12) / FP8_MAX  # [R]
    b_v = b_x / b_s[:, None]
    if ROUND_BEFORE_CONVERT:
        b_v = _round_to_e4m3(b_v)
    return b_v.to(FP8), b_s


@jit
def _load_partial(p_part, j, m_y, o_zero, SPLITS, R: tl.constexpr, C: tl.constexpr):
    """Range j's partial, zeros when there is no range j (x + 0 == x)."""
    return tl.load(p_part + j * (R * C), mask=m_y & (o_zero + j < SPLITS), other=0.0,
                   cache_modifier=".cg")


@jit
def store_split(b_acc, y, o_y, m_y, part, arrivals, tile, i_s, SPLITS,
                R: tl.constexpr, C: tl.constexpr, GROUP: tl.constexpr = 4):
    """Write the fp32 tile `b_acc` [R, C] to `y + o_y` (mask `m_y`) in y's dtype. With
    SPLITS > 1 it is range `i_s` of output tile `tile`: the partial goes to `part`, and the
    range arriving last at `arrivals[tile]` adds all of them in range order, writes y and
    resets the counter. It loads GROUP (4 or 8) partials before adding them: one L2 round
    trip per GROUP ranges; the sum's order, hence its bits, does not depend on GROUP."""
    if SPLITS == 1:
        tl.store(y + o_y, b_acc.to(y.dtype.element_ty), mask=m_y)
    else:
        p_part = part + (tile * SPLITS).to(tl.int64) * (R * C) \
            + tl.arange(0, R)[:, None] * C + tl.arange(0, C)[None, :]
        tl.store(p_part + i_s * (R * C), b_acc, mask=m_y)
        # Every warp's partial is written before the release; the last arrival acquires them all.
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            tl.debug_barrier()
            b_sum = tl.zeros([R, C], dtype=tl.float32)
            o_zero = tl.zeros([R, C], dtype=tl.int32)
            for i in range(0, SPLITS, GROUP):
                b_0 = _load_partial(p_part, i, m_y, o_zero, SPLITS, R, C)
                b_1 = _load_partial(p_part, i + 1, m_y, o_zero, SPLITS, R, C)
                b_2 = _load_partial(p_part, i + 2, m_y, o_zero, SPLITS, R, C)
                b_3 = _load_partial(p_part, i + 3, m_y, o_zero, SPLITS, R, C)
                if GROUP == 8:
                    b_4 = _load_partial(p_part, i + 4, m_y, o_zero, SPLITS, R, C)
                    b_5 = _load_partial(p_part, i + 5, m_y, o_zero, SPLITS, R, C)
                    b_6 = _load_partial(p_part, i + 6, m_y, o_zero, SPLITS, R, C)
                    b_7 = _load_partial(p_part, i + 7, m_y, o_zero, SPLITS, R, C)
                b_sum = (((b_sum + b_0) + b_1) + b_2) + b_3
                if GROUP == 8:
                    b_sum = (((b_sum + b_4) + b_5) + b_6) + b_7
            tl.store(y + o_y, b_sum.to(y.dtype.element_ty), mask=m_y)
            tl.atomic_xchg(arrivals + tile, 0, sem="relaxed")


def plan_splits(device: torch.device, tiles: int, k: int, block: int, waves: float,
                min_split_blocks: int) -> tuple[int, int, torch.Tensor | None]:
    """K ranges for `tiles` output tiles: split until about `waves` programs per SM stream the
    weight, at least `min_split_blocks` scale blocks per range. Returns (splits, K per range,
    the arrival counters; None with one range)."""
    k_blocks = triton.cdiv(k, block)
    want = int(num_sms(device) * waves)
    splits = max(1, min(k_blocks // min_split_blocks, triton.cdiv(want, tiles)))
    arrivals = ARRIVALS.get(device, tiles) if splits > 1 else None
    if arrivals is None:
        splits = 1
    k_per_split = triton.cdiv(k_blocks, splits) * block
    return triton.cdiv(k, k_per_split), k_per_split, arrivals


def split_buffer(splits: int, tiles: int, tile_size: int, out: torch.Tensor) -> torch.Tensor:
    """The fp32 partials of a split launch (`out`, never read, with one range)."""
    if splits == 1:
        return out
    return torch.empty(tiles * splits * tile_size, dtype=torch.float32, device=out.device)


__all__ = ["ARRIVALS", "FP8_MAX", "has_fp8_products", "plan_splits", "quantize_rows",
           "split_buffer", "store_split"]
