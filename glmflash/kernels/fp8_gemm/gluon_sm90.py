"""Block-scaled FP8 GEMM for SM90 in Gluon, warp-specialised: `out = (A * a_s) (B * b_s)^T` with
A `[R, K]` e4m3 and one fp32 scale per (row, 128 columns), B `[N, K]` e4m3 with one scale per
128 x 128 block, fp32 accumulation (DeepSeek's W8A8 numerics, as the Triton W8A8 kernels).

Why Gluon: each 128-wide K block's product must be scaled before it joins the accumulator (the
"promotion"), and Triton's pipeliner waits for every wgmma there, so its W8A8 loops run at about
half the FP8 rate (README.md); its automatic warp specialisation hangs under Triton 3.6. Here
the partitions are written out (DeepGEMM's structure):
- a one-warp producer streams tiles into a ring of STAGES shared-memory slots by TMA: A as two
  64-row tiles, one per consumer, and one [128, 128] tile of B;
- two consumer warpgroups (the default partition and a 4-warp worker) each own 64 rows of the
  128-row tile. A consumer starts a step's product, promotes the last step's with scales it
  loaded a step earlier, waits for the new product and frees its slot (every thread arrives,
  so no warpgroup barrier comes first); the other consumer's product keeps the tensor cores
  busy too, as the two are not in lockstep.
- By default a program per SM walks the output tiles (`GluonGemmConfig.persistent`): the
  producer fills the ring with a tile's first steps while the consumers store the last one.

Rows may be grouped (the fused MoE's sorted layout): row block i belongs to expert
`block_expert[i]` (-1: unused) and B is the stacked `[E * N, K]` weights. Three epilogues:
- STORE_ROWS: bf16 rows at their own index (a dense GEMM);
- SCATTER_ROWS: row r goes to `row_map[r]` (the MoE down projection: one row per pair), rows
  whose pair is `num_valid` or more are dropped;
- GATED: two passes over K through the same ring, gate then up (B0, B1); the gate tile waits
  in shared memory; h = silu(min(gate, L)) * clip(up, -L, L) is quantised to e4m3 per row over
  the tile's 128 columns (its scale is the down projection's activation scale), the scales
  stored K-block-major.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmflash.kernels.fp8_gemm.triton_common import FP8_MAX
from glmflash.kernels.triton_utils import constexpr, gluon_async_load, grouped_tile, num_sms

try:
    import triton
    import triton.language as tl
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    tma_load = gluon_async_load(tma)
except ImportError:  # older Triton, or none: the Triton kernels serve every call
    gluon = None

# The epilogues (module docstring); constexprs, so that the kernels read them.
STORE_ROWS, SCATTER_ROWS, GATED = constexpr(0), constexpr(1), constexpr(2)


@dataclass(frozen=True)
class GluonGemmConfig:
    """Launch shape: [128, 128] output tiles over 128-wide K steps (one scale block each way),
    so only the ring, the tile order, the grid and the registers are free."""

    stages: int = 6
    """Ring slots of A and B tiles (32 KB each)."""
    gated_stages: int = 4
    """Slots in the gated form, whose gate tiles take 64 KB more."""
    group_m: int = 8
    """Row blocks that walk the column tiles together (weights and rows stay in L2)."""
    consumer_regs: int = 240
    producer_regs: int = 24
    max_regs: int = 168
    """Registers a thread at launch: 12 warps (two consumer warpgroups and the producer's)
    share the 64K; each warpgroup then takes its own count (240 + 240 + 24 = 3 x 168)."""
    persistent: bool = True
    """A program per SM walking the tiles (the producer fills the ring with the next tile's
    steps while the consumers store the last), instead of a program per tile."""
    wide_stores: bool = True
    """Store output tiles as 16-byte vectors (the tile moved into a row-major register layout
    through shared memory first) instead of from the product's layout, 2-4 bytes a store."""
    stash_swizzle: bool = True
    """GATED: the gate tile's shared-memory stash swizzled in 32-byte groups (row-major, it
    takes 8-way bank conflicts from the product's layout)."""


GLUON_CONFIG = GluonGemmConfig()
BLOCK_M = BLOCK_N = BLOCK_K = 128


def available(device: torch.device) -> bool:
    """Whether the Gluon kernel runs here: Gluon imported and the device is an SM90 GPU."""
    return (gluon is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] == 9)


if gluon is not None:

    @gluon.jit
    def _producer(a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, block_expert,
                  num_row_blocks, N, k_steps, PASSES: gl.constexpr, GROUPED: gl.constexpr,
                  GROUP_M: gl.constexpr):
        """TMA loads into the ring, tile after tile (`_tile`), a K step a slot (A's two 64-row
        tiles and a [BN, BK] tile of B): per tile B0's rows over K, then (PASSES == 2) B1's;
        a slot is refilled once both consumers have released it."""
        STAGES: gl.constexpr = b_bufs.type.shape[0]
        BK: gl.constexpr = a_desc.block_type.shape[1]
        BN: gl.constexpr = b0_desc.block_type.shape[0]
        nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b0_desc.block_type.nbytes
        i = 0  # ring steps so far, over every tile of this program
        tile = gl.program_id(0)
        while tile < num_row_blocks * gl.cdiv(N, BN):
            i_m, i_n, expert, tile = _tile(tile, block_expert, num_row_blocks, N, BN, GROUPED,
                                           GROUP_M)
            if expert >= 0:
                a_row = i_m * 2 * a_desc.block_type.shape[0]
                b_row = expert * N + i_n * BN
                for j in range(k_steps * PASSES):
                    s = i % STAGES
                    # A fresh barrier counts as completed phase 1, so the first lap does not
                    # wait.
                    mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                    mbarrier.expect(ready.index(s), nbytes)
                    k = (j % k_steps) * BK
                    # A as two 64-row tiles, one per consumer warpgroup.
                    tma_load(a_desc, [a_row, k], ready.index(s), a_bufs.index(2 * s))
                    tma_load(a_desc, [a_row + 64, k], ready.index(s), a_bufs.index(2 * s + 1))
                    if j < k_steps:
                        tma_load(b0_desc, [b_row, k], ready.index(s), b_bufs.index(s))
                    else:
                        tma_load(b1_desc, [b_row, k], ready.index(s), b_bufs.index(s))
                    i += 1

    @gluon.jit
    def _tile(tile, block_expert, num_row_blocks, N, BN: gl.constexpr, GROUPED: gl.constexpr,
              GROUP_M: gl.constexpr):
        """(row block, column tile, expert, this program's next tile) of a tile number; expert
        -1: nothing to do. The used row blocks come first (the sort's layout), so once the
        first row block of the tile's group is unused, no tile after it has work: the next
        tile is then past the last."""
        num_n = gl.cdiv(N, BN)
        i_m, i_n = grouped_tile(tile, num_row_blocks, num_n, GROUP_M)
        expert = 0
        next_tile = tile + gl.num_programs(0)
        if GROUPED:
            expert = gl.load(block_expert + i_m)
            first_m = tile // (GROUP_M * num_n) * GROUP_M
            if gl.load(block_expert + first_m) < 0:
                next_tile = num_row_blocks * num_n
        return i_m, i_n, expert, next_tile

    @gluon.jit
    def _product(a_bufs, b_bufs, s, spare, WG: gl.constexpr):
        """Start this warpgroup's wgmma of slot s: its 64 rows of A times B^T, into the
        registers of `spare` (the last product, already promoted: use_acc=False ignores its
        values, and reusing it keeps a constant zero tile out of the registers)."""
        a = a_bufs.index(2 * s + WG)
        b = b_bufs.index(s).permute((1, 0))
        return warpgroup_mma(a, b, spare, use_acc=False, is_async=True)

    @gluon.jit
    def _scales(p_as, m_rows, stride_as, p_bs, k):
        """(a_s[:, k], b_s[k]): the rows' scales of K block k and B's. B's is loaded as a
        vector over the rows (p_bs holds one address per row) masked like the rows' own: a
        scalar would be warp-uniform, and ptxas moves a uniform load's result into a uniform
        register at once, waiting for the load there."""
        return (gl.load(p_as + k * stride_as, mask=m_rows, other=0.0),
                gl.load(p_bs + k, mask=m_rows, other=0.0))

    @gluon.jit
    def _issue(a_bufs, b_bufs, ready, i, spare, WG: gl.constexpr):
        """Wait for ring step i's tiles and start this warpgroup's product of them."""
        STAGES: gl.constexpr = b_bufs.type.shape[0]
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        return _product(a_bufs, b_bufs, s, spare, WG)

    @gluon.jit
    def _finish(part, acc, empty, i):
        """Wait for the product in flight (acc passes through the wait, so that what computes
        it stays before the wait) and release ring step i's slot."""
        part, acc = warpgroup_mma_wait(0, deps=(part, acc))
        # Every thread releases the slot once its own product is done: cp.async's arrive
        # without an increment, which fires when the thread's earlier cp.async copies have
        # landed; a consumer issues none, so it arrives at once (a cp.async added to a consumer
        # would delay every release). A single arrival would need the warpgroup's bar.sync
        # first.
        cp.mbarrier_arrive(empty.index(i % empty.type.shape[0]), increment_count=False)
        return part, acc

    @gluon.jit
    def _promote(acc, part, scales):
        """acc + part scaled by its step's (a_s, b_s)."""
        a_s, b_s = scales
        return acc + part * gl.expand_dims(a_s * b_s, 1)

    @gluon.jit
    def _k_loop(a_bufs, b_bufs, ready, empty, p_as, m_rows, stride_as, p_bs, i0, k_steps,
                WG: gl.constexpr, acc_layout: gl.constexpr):
        """sum over k of (A_k B_k^T) * a_s[:, k] * b_s[k] over ring steps i0 ..
        i0 + k_steps - 1. p_as: the rows' scales of K block 0 (K blocks `stride_as` apart),
        p_bs: B's scale of K block 0 (contiguous in k), an address per row.

        Each step's product is started before the last step's promotion, so that the promotion
        of step k runs beside the product of step k + 1 (and the other warpgroup's). Unrolled
        by two, so that the two products' registers keep their roles (no copies between them).

        Each step's scales are loaded a step before it: ptxas places whatever reads them
        (their product, a register copy) among the step's wgmma instructions, so scales loaded
        in the step held the step's later wgmma until they arrived (tools/gluon_check.py
        checks the SASS for it)."""
        BN: gl.constexpr = b_bufs.type.shape[1]
        acc = gl.zeros([64, BN], gl.float32, acc_layout)
        part = acc
        part1 = acc
        even = _scales(p_as, m_rows, stride_as, p_bs, 0)
        # Past the last block: block 0 again, unused (a select, not a division among the
        # products).
        odd = _scales(p_as, m_rows, stride_as, p_bs, 1 * (1 < k_steps))
        part, acc = _finish(_issue(a_bufs, b_bufs, ready, i0, part, WG), acc, empty, i0)
        # At the top of each iteration step k's product is done and not yet promoted, and the
        # scales of steps k and k + 1 are loaded.
        for k in range(0, k_steps - 2, 2):
            part1 = _issue(a_bufs, b_bufs, ready, i0 + k + 1, part1, WG)
            acc = _promote(acc, part, even)
            even = _scales(p_as, m_rows, stride_as, p_bs, k + 2)
            part1, acc = _finish(part1, acc, empty, i0 + k + 1)
            part = _issue(a_bufs, b_bufs, ready, i0 + k + 2, part, WG)
            acc = _promote(acc, part1, odd)
            odd = _scales(p_as, m_rows, stride_as, p_bs, (k + 3) * (k + 3 < k_steps))
            part, acc = _finish(part, acc, empty, i0 + k + 2)
        if k_steps % 2 == 0:
            part1 = _issue(a_bufs, b_bufs, ready, i0 + k_steps - 1, part1, WG)
            acc = _promote(acc, part, even)
            part1, acc = _finish(part1, acc, empty, i0 + k_steps - 1)
            acc = _promote(acc, part1, odd)
        else:
            acc = _promote(acc, part, even)
        return acc

    @gluon.jit
    def _store_tile(y, out, row_map, row0, col0, R, N, num_valid, stride_om,
                    SCATTER: gl.constexpr, WIDE: gl.constexpr):
        """y (64 rows) into rows row0 .. (or, SCATTER, their row_map entries below num_valid)
        and columns col0 .. of out; WIDE: as 16-byte vectors (GluonGemmConfig.wide_stores)."""
        BN: gl.constexpr = y.shape[1]
        if WIDE:
            VEC: gl.constexpr = 128 // y.dtype.primitive_bitwidth
            y = gl.convert_layout(y, gl.BlockedLayout([1, VEC], [32 * VEC // BN, BN // VEC],
                                                      [4, 1], [1, 0]))
        o_r = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, y.type.layout))
        o_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, y.type.layout))
        m_r = o_r < R
        if SCATTER:
            dest = gl.load(row_map + o_r, mask=m_r, other=num_valid)
            m_r = dest < num_valid
            o_r = gl.where(m_r, dest, 0)
        p_o = out + gl.expand_dims(o_r.to(gl.int64) * stride_om, 1) + gl.expand_dims(o_n, 0)
        gl.store(p_o, y, mask=gl.expand_dims(m_r, 1) & gl.expand_dims(o_n < N, 0))

    @gluon.jit
    def _gated_epilogue(gate, up, out, out_scale, row0, col0, o_r, m_r, i_block, R, N, limit,
                        stride_om, stride_osk, WIDE: gl.constexpr):
        """h = silu(gate) * clip(up, -limit, limit) (gate already clamped above), quantised per
        row over these 128 columns: e4m3 codes into out, the row scales into block i_block of
        out_scale (K-block-major, as the down projection reads them)."""
        BN: gl.constexpr = gate.shape[1]
        o_n = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, gate.type.layout))
        # NaN kept as torch's clamp keeps it (gl.minimum / gl.maximum drop it by default).
        up = gl.maximum(up, -limit, propagate_nan=tl.PropagateNan.ALL)
        up = gl.minimum(up, limit, propagate_nan=tl.PropagateNan.ALL)
        h = gate / (1.0 + gl.exp(-gate)) * up
        # Columns past N (the next expert's rows of B) must not reach the row's amax.
        h = gl.where(gl.expand_dims(o_n < N, 0), h, 0.0)
        scale = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-12) / FP8_MAX
        codes = (h / gl.expand_dims(scale, 1)).to(out.dtype.element_ty)
        _store_tile(codes, out, out, row0, col0, R, N, R, stride_om, False, WIDE)
        gl.store(out_scale + i_block * stride_osk + o_r, scale, mask=m_r)

    @gluon.jit
    def _consumer_tile(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale,
                       out, out_scale, row_map, row0, col0, bs_row, i0, k_steps, N, R,
                       num_valid, limit, stride_as, stride_bsn, stride_om, stride_osk,
                       MODE: gl.constexpr, WG: gl.constexpr, WIDE_STORES: gl.constexpr):
        """One consumer warpgroup's part of one tile: rows row0 + 64 WG .. ; the K loop from
        ring step i0 (gate's, then up's, when GATED), then the epilogue of MODE."""
        BN: gl.constexpr = b_bufs.type.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
        row_first = row0 + WG * 64
        o_r = row_first + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_layout))
        m_r = o_r < R
        p_as = a_scale + o_r
        i_block = col0 // BN
        # B's scales at one address per row (_scales says why).
        bs_rows = bs_row + i_block * stride_bsn + o_r * 0
        acc = _k_loop(a_bufs, b_bufs, ready, empty, p_as, m_r, stride_as, b0_scale + bs_rows,
                      i0, k_steps, WG, acc_layout)
        if MODE == GATED:
            gate_buf.index(WG).store(gl.minimum(acc, limit, propagate_nan=tl.PropagateNan.ALL))
            up = _k_loop(a_bufs, b_bufs, ready, empty, p_as, m_r, stride_as,
                         b1_scale + bs_rows, i0 + k_steps, k_steps, WG, acc_layout)
            gate = gate_buf.index(WG).load(acc_layout)
            _gated_epilogue(gate, up, out, out_scale, row_first, col0, o_r, m_r, i_block, R, N,
                            limit, stride_om, stride_osk, WIDE_STORES)
        else:
            _store_tile(acc.to(out.dtype.element_ty), out, row_map, row_first, col0, R, N,
                        num_valid, stride_om, MODE == SCATTER_ROWS, WIDE_STORES)

    @gluon.jit
    def _consumer(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale, out,
                  out_scale, row_map, block_expert, num_row_blocks, k_steps, N, R, num_valid,
                  limit, stride_as, stride_bse, stride_bsn, stride_om, stride_osk,
                  MODE: gl.constexpr, GROUPED: gl.constexpr, GROUP_M: gl.constexpr,
                  WIDE_STORES: gl.constexpr, WG: gl.constexpr):
        """One consumer warpgroup over this program's tiles, in the producer's order."""
        BN: gl.constexpr = b_bufs.type.shape[1]
        PASSES: gl.constexpr = 2 if MODE == GATED else 1
        i0 = 0  # ring steps so far
        tile = gl.program_id(0)
        while tile < num_row_blocks * gl.cdiv(N, BN):
            i_m, i_n, expert, tile = _tile(tile, block_expert, num_row_blocks, N, BN, GROUPED,
                                           GROUP_M)
            if expert >= 0:
                _consumer_tile(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale,
                               b1_scale, out, out_scale, row_map, i_m * 128, i_n * BN,
                               expert * stride_bse, i0, k_steps, N, R, num_valid, limit,
                               stride_as, stride_bsn, stride_om, stride_osk, MODE, WG,
                               WIDE_STORES)
                i0 += k_steps * PASSES

    @gluon.jit
    def _consumer_wg0(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale,
                      out, out_scale, row_map, block_expert, num_row_blocks, k_steps, N, R,
                      num_valid, limit, stride_as, stride_bse, stride_bsn, stride_om,
                      stride_osk, MODE: gl.constexpr, GROUPED: gl.constexpr,
                      GROUP_M: gl.constexpr, WIDE_STORES: gl.constexpr):
        # NOTE: a partition's warpgroup index must reach `_consumer` as a constexpr; passed
        # through warp_specialize's argument tuple it became a runtime value, every branch of
        # the epilogue was compiled, and one that could not lower crashed the compiler.
        _consumer(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale, out,
                  out_scale, row_map, block_expert, num_row_blocks, k_steps, N, R, num_valid,
                  limit, stride_as, stride_bse, stride_bsn, stride_om, stride_osk, MODE,
                  GROUPED, GROUP_M, WIDE_STORES, 0)

    @gluon.jit
    def _consumer_wg1(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale,
                      out, out_scale, row_map, block_expert, num_row_blocks, k_steps, N, R,
                      num_valid, limit, stride_as, stride_bse, stride_bsn, stride_om,
                      stride_osk, MODE: gl.constexpr, GROUPED: gl.constexpr,
                      GROUP_M: gl.constexpr, WIDE_STORES: gl.constexpr):
        _consumer(a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale, b1_scale, out,
                  out_scale, row_map, block_expert, num_row_blocks, k_steps, N, R, num_valid,
                  limit, stride_as, stride_bse, stride_bsn, stride_om, stride_osk, MODE,
                  GROUPED, GROUP_M, WIDE_STORES, 1)

    @gluon.jit
    def block_fp8_gemm_kernel(a_desc, b0_desc, b1_desc, a_scale, b0_scale, b1_scale, out,
                              out_scale, row_map, block_expert, R, N, K, num_row_blocks,
                              num_valid, limit, stride_as, stride_bse, stride_bsn, stride_om,
                              stride_osk, MODE: gl.constexpr, GROUPED: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                              WIDE_STORES: gl.constexpr,
                              STASH_SWIZZLE: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr):
        """[128, 128] output tiles, tile numbers program_id, + num_programs, ... (one a
        program, or a program per SM walking them): see the module docstring. a_scale
        `[K/128, R]` (row stride `stride_as`), b*_scale `[E, N/128, K/128]`; out_scale (GATED)
        `[N/128, R]`."""
        BN: gl.constexpr = b0_desc.block_type.shape[0]
        k_steps = gl.cdiv(K, a_desc.block_type.shape[1])
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape,
                                           a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b0_desc.dtype, [STAGES] + b0_desc.block_type.shape,
                                           b0_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            # Every thread of the two consumer warpgroups arrives.
            mbarrier.init(empty.index(s), count=2 * gl.num_warps() * 32)
        # The gated form's gate tiles wait here for the up pass.
        # Swizzled (STASH_SWIZZLE): 32-byte groups of a row XOR-ed with the row mod 4.
        stash_layout: gl.constexpr = gl.SwizzledSharedLayout(
            8 if STASH_SWIZZLE else 1, 1, 4 if STASH_SWIZZLE else 1, [1, 0])
        if MODE == GATED:
            gate_buf = gl.allocate_shared_memory(gl.float32, [2, 64, BN], stash_layout)
        else:
            gate_buf = gl.allocate_shared_memory(gl.float32, [2, 1, 1], stash_layout)
        fence_async_shared()
        # NOTE: the argument tuples are written out in the call: a tuple assigned to a name
        # first turns its constexprs into run-time values.
        gl.warp_specialize([
            (_consumer_wg0, (a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale,
                             b1_scale, out, out_scale, row_map, block_expert, num_row_blocks,
                             k_steps, N, R, num_valid, limit, stride_as, stride_bse, stride_bsn,
                             stride_om, stride_osk, MODE, GROUPED, GROUP_M, WIDE_STORES)),
            (_consumer_wg1, (a_bufs, b_bufs, gate_buf, ready, empty, a_scale, b0_scale,
                             b1_scale, out, out_scale, row_map, block_expert, num_row_blocks,
                             k_steps, N, R, num_valid, limit, stride_as, stride_bse, stride_bsn,
                             stride_om, stride_osk, MODE, GROUPED, GROUP_M, WIDE_STORES)),
            (_producer, (a_desc, b0_desc, b1_desc, a_bufs, b_bufs, ready, empty, block_expert,
                         num_row_blocks, N, k_steps, 2 if MODE == GATED else 1, GROUPED,
                         GROUP_M)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _descriptor(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float8e4nv)
    return TensorDescriptor.from_tensor(t, block, layout)


def _check_k(k: int) -> None:
    assert k > 0 and k % 16 == 0, "TMA reads rows whose byte length is a multiple of 16"


def kernel_call(a, a_scale, b0, s0, b1, s1, out, out_scale, row_map, block_expert, *, rows: int,
                n: int, k: int, num_row_blocks: int, num_valid: int, limit: float, mode: int,
                config: GluonGemmConfig) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keyword arguments) of one `block_fp8_gemm_kernel` launch; also what
    tools/gluon_check.py compiles, so both take the same arguments."""
    a_desc = _descriptor(a, [BLOCK_M // 2, BLOCK_K])
    b0_desc = _descriptor(b0.reshape(-1, k), [BLOCK_N, BLOCK_K])
    b1_desc = b0_desc if b1 is None else _descriptor(b1.reshape(-1, k), [BLOCK_N, BLOCK_K])
    s1 = s0 if s1 is None else s1
    grouped = block_expert is not None
    tiles = num_row_blocks * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, num_sms(a.device)) if config.persistent else tiles,)
    args = (a_desc, b0_desc, b1_desc, a_scale, s0, s1, out, out_scale, row_map, block_expert,
            rows, n, k, num_row_blocks, num_valid, float(limit), a_scale.stride(1),
            s0.stride(0) if grouped else 0, s0.stride(-2), out.stride(0),
            out_scale.stride(0) if out_scale is not None else 0)
    kwargs = dict(MODE=mode, GROUPED=grouped,
                  STAGES=config.gated_stages if mode == GATED else config.stages,
                  GROUP_M=config.group_m,
                  WIDE_STORES=config.wide_stores, STASH_SWIZZLE=config.stash_swizzle,
                  CONSUMER_REGS=config.consumer_regs,
                  PRODUCER_REGS=config.producer_regs, num_warps=4, maxnreg=config.max_regs)
    return grid, args, kwargs


def _launch(*tensors, **shape) -> None:
    grid, args, kwargs = kernel_call(*tensors, **shape)
    block_fp8_gemm_kernel[grid](*args, **kwargs)


def gemm(aq: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
         out_dtype: torch.dtype, config: GluonGemmConfig = GLUON_CONFIG) -> torch.Tensor:
    """Dense `[M, K] x [N, K]^T`: aq e4m3 with scales `a_scale` `[M, K/128]` whose row stride
    is 1 (quantize_activations(scales_m_major=True)), weight e4m3 `[N, K]` with `scale`
    `[N/128, K/128]`."""
    m, k = aq.shape
    n = weight.shape[0]
    _check_k(k)
    assert a_scale.stride(0) == 1, "row scales must be M-major"
    out = torch.empty(m, n, dtype=out_dtype, device=aq.device)
    _launch(aq, a_scale, weight, scale.float().contiguous(), None, None, out, None, None, None,
            rows=m, n=n, k=k, num_row_blocks=triton.cdiv(m, BLOCK_M), num_valid=m, limit=0.0,
            mode=STORE_ROWS, config=config)
    return out


def grouped_gate_up(aq: torch.Tensor, a_scale: torch.Tensor, block_expert: torch.Tensor,
                    w_gate: torch.Tensor, s_gate: torch.Tensor, w_up: torch.Tensor,
                    s_up: torch.Tensor, *, limit: float,
                    config: GluonGemmConfig = GLUON_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """h of every sorted row: aq `[R, D]` e4m3 rows in the sorted layout (128-row blocks, block
    i of expert block_expert[i]) with scales `[R, D/128]` M-major -> (h e4m3 `[R, I]`, its
    scales `[R, I/128]`, M-major)."""
    rows, hidden = aq.shape
    inter = w_gate.shape[1]
    _check_k(hidden)
    assert rows == block_expert.numel() * BLOCK_M and a_scale.stride(0) == 1
    hq = torch.empty(rows, inter, dtype=w_gate.dtype, device=aq.device)
    hs = torch.empty(triton.cdiv(inter, BLOCK_N), rows, dtype=torch.float32,
                     device=aq.device).t()
    _launch(aq, a_scale, w_gate, s_gate, w_up, s_up, hq, hs.t(), None, block_expert, rows=rows,
            n=inter, k=hidden, num_row_blocks=block_expert.numel(), num_valid=rows,
            limit=limit, mode=GATED, config=config)
    return hq, hs


def grouped_down(hq: torch.Tensor, hs: torch.Tensor, block_expert: torch.Tensor,
                 sorted_pairs: torch.Tensor, w_down: torch.Tensor, s_down: torch.Tensor,
                 num_pairs: int, out_dtype: torch.dtype,
                 config: GluonGemmConfig = GLUON_CONFIG) -> torch.Tensor:
    """y `[num_pairs, D]`: each sorted row's h W_down^T into its pair's row (padding rows
    dropped; rows of skipped pairs unwritten)."""
    rows, inter = hq.shape
    hidden = w_down.shape[1]
    _check_k(inter)
    y = torch.empty(num_pairs, hidden, dtype=out_dtype, device=hq.device)
    _launch(hq, hs, w_down, s_down, None, None, y, None, sorted_pairs, block_expert, rows=rows,
            n=hidden, k=inter, num_row_blocks=block_expert.numel(), num_valid=num_pairs,
            limit=0.0, mode=SCATTER_ROWS, config=config)
    return y


__all__ = ["GLUON_CONFIG", "GluonGemmConfig", "available", "gemm", "grouped_down",
           "grouped_gate_up"]
