"""Sparse MLA on SM90 in Gluon, warp-specialised: the schedule of FlashMLA and TileLang's
pipelined sparse MLA, written as three partitions of one program (README.md "The Gluon form").

A work item is one query, 64 heads and a range of the query's selected slots, as a program of
the Triton kernel is (same split plan, same partials and combine); a program per SM walks its
items in turn (persistent), so the next item's query and first gathers load while the last one
finishes. Its partitions:
- a producer (4 warps) gathers each step's `block_slots` latent rows into a ring of shared
  slots with `cp.async` (Hopper's TMA cannot gather rows), padded slots (-1) zero-filled at no
  memory cost, and arrives on the slot's barrier when its copies have landed; the query's
  64 x 512 rows are its first copies;
- the scores warpgroup (the default partition) computes S = Q K^T over both 256-column halves,
  keeps the fp32 online softmax in log2 units, publishes P (bf16) and the step's rescale factor
  through shared memory, and accumulates the left 256 value columns P V_L;
- the value warpgroup waits for P and accumulates the right 256 columns P V_R.
So the gathers run ahead of the math by the ring's depth, and the value warpgroup's product of
step i overlaps the scores of step i + 1.

Each product reads its operands from shared memory (wgmma's async proxy), while `cp.async` and
the P stores write through the generic proxy: every reader fences (`fence_async_shared`) after
the barrier that says the data is there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from glmflash.kernels.sparse_mla.combine_triton import combine
from glmflash.kernels.sparse_mla.plan import (
    HEAD_BLOCK,
    LOG2E,
    SparseMlaConfig,
    SparseMlaWorkspace,
    SplitPlan,
    new_output,
    split_plan,
)
from glmflash.kernels.sparse_mla.triton_impl import online_softmax_step
from glmflash.kernels.triton_utils import constexpr, gluon_async_load, interpreting, num_sms

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    cp_async_load = gluon_async_load(cp)
except ImportError:  # older Triton, or none: the Triton kernel serves every call
    gluon = None

RANK = 512
"""Latent width this kernel is built for (two 256-column halves)."""
HEADS, HALF = constexpr(HEAD_BLOCK), constexpr(RANK // 2)


@dataclass(frozen=True)
class GluonSparseMlaConfig:
    """Launch shape of the Gluon sparse MLA."""

    block_slots: int = 64
    """Slots gathered per step (the N of the score product, the K of the value product)."""
    stages: int = 2
    """Ring slots of gathered steps (64 KB each at 64 slots)."""
    waves: float = 1.0
    """Programs per SM that splitting a decode's selection aims for."""
    min_split_steps: int = 1
    """Whole steps each split gets at least."""
    min_program_steps: int = 4
    """`serves` takes launches whose work items run at least this many steps (README.md "The
    Gluon form" has the measurements behind it)."""
    persistent: bool = True
    """A program per SM walks work items (query x head block x split) in turn, so that the
    next item's query and first gathers load while the last one finishes; else a program per
    item."""
    producer_warps: int = 4
    """Warps of the producer partition (one warpgroup: its registers are set per group)."""
    value_regs: int = 160
    """Registers a thread of the value warpgroup keeps (its [64, 256] fp32 accumulator is
    128)."""
    producer_regs: int = 96
    """Registers a thread of the producer keeps (a step's gather addresses)."""
    max_regs: int = 168
    """Registers a thread at launch: the 12 warps share the 64K; the value warpgroup and the
    producer then take their counts and the scores warpgroup the rest (3 x 168 - 160 - 96 =
    248)."""
    combine: SparseMlaConfig = SparseMlaConfig()
    """The combine launch of split launches (its `combine_heads`, `combine_elements`)."""

    def __post_init__(self) -> None:
        if self.block_slots not in (16, 32, 64) or self.stages < 2:
            raise ValueError("block_slots must be 16, 32 or 64 and stages at least 2")
        regs = (self.value_regs, self.producer_regs, self.max_regs)
        if any(r % 8 or not 24 <= r <= 256 for r in regs):
            raise ValueError(f"register counts {regs} must be multiples of 8 in [24, 256]")
        if 3 * self.max_regs - self.value_regs - self.producer_regs > 256:
            raise ValueError("the scores warpgroup would take more than 256 registers")

    def split_config(self) -> SparseMlaConfig:
        """The split rule of plan.py with this launch's waves and minimum steps."""
        return dataclasses.replace(self.combine, waves=self.waves,
                                   min_split_steps=self.min_split_steps)


GLUON_SPARSE_MLA_CONFIG = GluonSparseMlaConfig()


def serves(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor,
           workspace: SparseMlaWorkspace | None = None,
           config: GluonSparseMlaConfig = GLUON_SPARSE_MLA_CONFIG) -> bool:
    """Whether `sparse_mla` (kernels/sparse_mla/__init__.py) launches this kernel: where it
    runs, and where its programs are long enough for it to be the faster kernel."""
    return (q_lat.shape[0] > 0 and available(q_lat, latent) and not interpreting()
            and plan_for(q_lat, slots, config, workspace).steps_per_split
            >= config.min_program_steps)


def available(q_lat: torch.Tensor, latent: torch.Tensor) -> bool:
    """Whether this kernel serves the call: Gluon, an SM90 GPU, bf16, heads a multiple of 64
    and the 512-wide latent."""
    return (gluon is not None and q_lat.is_cuda
            and torch.cuda.get_device_capability(q_lat.device)[0] == 9
            and q_lat.dtype == torch.bfloat16 and latent.dtype == torch.bfloat16
            and q_lat.shape[1] % HEAD_BLOCK == 0 and q_lat.shape[2] == RANK)


if gluon is not None:

    @gluon.jit
    def _item(w, H, W, NUM_SPLITS, STEPS_PER, EXTRA_STEPS, BN: gl.constexpr):
        """Work item w: (query, split, first head, slot range, steps). Items are numbered split
        fastest, then head block, then query. The last split runs on to W in whole steps (its
        last one masked)."""
        i_s = w % NUM_SPLITS
        rest = w // NUM_SPLITS
        head_blocks = H // HEADS
        i_t = (rest // head_blocks).to(gl.int64)
        head0 = (rest % head_blocks) * HEADS
        w_begin = (i_s * STEPS_PER + gl.minimum(i_s, EXTRA_STEPS)) * BN
        w_end = w_begin + (STEPS_PER + (i_s < EXTRA_STEPS).to(gl.int32)) * BN
        w_end = gl.where(i_s == NUM_SPLITS - 1, W, w_end)
        return i_t, i_s, head0, w_begin, w_end, gl.cdiv(w_end - w_begin, BN)

    @gluon.jit
    def _copy_rows(dst, src, rows, col0, stride_row, layout: gl.constexpr):
        """cp.async of src rows `rows` (-1: zero-filled, no traffic), columns col0 .. col0 +
        HALF, into dst [len(rows), HALF]."""
        o_c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        ptr = src + gl.expand_dims(rows.to(gl.int64) * stride_row, 1) + gl.expand_dims(o_c, 0)
        cp_async_load(dst, ptr, mask=gl.expand_dims(rows >= 0, 1), cache_modifier=".cg")

    @gluon.jit
    def _slot_rows(p_slot, w0, w_end, o_r):
        """The selected slots p_slot[w0 + o_r] (-1 from w_end on), as int32 (cache rows are
        fewer than 2^31; half the registers of int64 while they wait for their step)."""
        o_n = w0 + o_r
        return gl.load(p_slot + o_n, mask=o_n < w_end, other=-1).to(gl.int32)

    @gluon.jit
    def _issue_step(kv_smem, kv_ready, kv_empty, g, latent, idx, stride_l, layout: gl.constexpr):
        """The gathers of ring step g (slot indices idx) into its slot, once both warpgroups
        have released the slot's previous step."""
        STAGES: gl.constexpr = kv_ready.shape[0]
        s = g % STAGES
        # A fresh barrier counts as completed phase 1, so the first lap does not wait.
        mbarrier.wait(kv_empty.index(s), ((g // STAGES) & 1) ^ 1)
        for h in gl.static_range(2):
            _copy_rows(kv_smem.index(2 * s + h), latent, idx, h * HALF, stride_l, layout)
        cp.mbarrier_arrive(kv_ready.index(s), increment_count=False)

    @gluon.jit
    def _producer(q, latent, slots, q_smem, kv_smem, q_ready, q_free, kv_ready, kv_empty, H, W,
                  stride_qt, stride_qh, stride_l, stride_s, NUM_ITEMS, NUM_SPLITS, STEPS_PER,
                  EXTRA_STEPS, BN: gl.constexpr, WARPS: gl.constexpr):
        """Per work item: the first step's gathers (its slot frees while the last item is in
        its final step), the query's rows (once the scores warpgroup is done with the last
        item's), then the other steps' gathers. A step's slot indices are loaded while the
        step before it is issued and its slot waited for, so that its addresses are ready
        when the slot is."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        rows: gl.constexpr = gl.SliceLayout(1, layout)
        o_r = gl.arange(0, BN, layout=rows)
        # Steps issued by this program over all its items (the ring position), and items.
        g = 0
        k = 0
        for w in range(gl.program_id(0), NUM_ITEMS, gl.num_programs(0)):
            i_t, i_s, head0, w_begin, w_end, n_steps = _item(w, H, W, NUM_SPLITS, STEPS_PER,
                                                              EXTRA_STEPS, BN)
            p_slot = slots + i_t * stride_s
            idx = _slot_rows(p_slot, w_begin, w_end, o_r)
            if n_steps > 0:
                _issue_step(kv_smem, kv_ready, kv_empty, g, latent, idx, stride_l, layout)
                g += 1
                idx = _slot_rows(p_slot, w_begin + BN, w_end, o_r)
            # A fresh barrier counts as completed phase 1, so the first item does not wait.
            mbarrier.wait(q_free, (k & 1) ^ 1)
            heads = head0 + gl.arange(0, HEADS, layout=rows)
            for h in gl.static_range(2):
                _copy_rows(q_smem.index(h), q + i_t * stride_qt, heads, h * HALF, stride_qh,
                           layout)
            cp.mbarrier_arrive(q_ready, increment_count=False)
            for i in range(1, n_steps):
                _issue_step(kv_smem, kv_ready, kv_empty, g, latent, idx, stride_l, layout)
                g += 1
                idx = _slot_rows(p_slot, w_begin + (i + 1) * BN, w_end, o_r)
            k += 1

    @gluon.jit
    def _store_half(acc, row_sum, dst, row_stride, head0, H, col0, layout: gl.constexpr):
        """acc / row_sum (rows without a slot: 0) to dst rows head0.. (row_stride apart),
        columns col0 .. col0 + HALF."""
        row_sum = gl.convert_layout(row_sum, gl.SliceLayout(1, layout))
        out = acc / gl.expand_dims(gl.where(row_sum > 0, row_sum, 1.0), 1)
        o_h = head0 + gl.arange(0, HEADS, layout=gl.SliceLayout(1, layout))
        o_c = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        ptr = dst + gl.expand_dims(o_h.to(gl.int64) * row_stride, 1) + gl.expand_dims(o_c, 0)
        gl.store(ptr, out.to(dst.dtype.element_ty), mask=gl.expand_dims(o_h < H, 1))

    @gluon.jit
    def _destination(o, part_o, i_t, i_s, H, stride_ot, stride_oh, NUM_SPLITS,
                     IS_SPLIT: gl.constexpr):
        """(base, row stride) of a work item's output rows: the partial of (query, split) or
        the query's output."""
        if IS_SPLIT:
            return part_o + (i_t * NUM_SPLITS + i_s) * H * HALF * 2, 2 * HALF
        else:
            return o + i_t * stride_ot, stride_oh

    @gluon.jit
    def _scores(slots, q_smem, kv_smem, p_smem, alpha_smem, l_smem, q_ready, q_free, kv_ready,
                kv_empty, p_ready, p_free, fin, l_free, o, part_o, part_lse, scale_log2, H, W,
                stride_s, stride_ot, stride_oh, NUM_ITEMS, NUM_SPLITS, STEPS_PER, EXTRA_STEPS,
                BN: gl.constexpr, IS_SPLIT: gl.constexpr):
        """The scores warpgroup, per work item: S, the online softmax, P published, P V_L;
        at the end the sum for the value warpgroup, the left half of the output and (split)
        the log-sum-exp."""
        STAGES: gl.constexpr = kv_ready.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_r = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        g = 0
        k = 0
        for w in range(gl.program_id(0), NUM_ITEMS, gl.num_programs(0)):
            i_t, i_s, head0, w_begin, w_end, n_steps = _item(w, H, W, NUM_SPLITS, STEPS_PER,
                                                              EXTRA_STEPS, BN)
            p_slot = slots + i_t * stride_s
            m = gl.full([HEADS], float("-inf"), gl.float32, row_s)
            l_sum = gl.zeros([HEADS], gl.float32, row_s)
            acc = gl.zeros([HEADS, HALF], gl.float32, o_layout)
            # The scores' registers (use_acc=False ignores their values); made per item so
            # that they are free during its output stores.
            s = gl.zeros([HEADS, BN], gl.float32, s_layout)
            # Which slots are real (not -1 padding), loaded a step ahead of their scores.
            idx = _slot_rows(p_slot, w_begin, w_end, o_r)
            mbarrier.wait(q_ready, k & 1)
            for i in range(n_steps):
                st = g % STAGES
                pb = g % 2
                valid = idx >= 0
                idx = _slot_rows(p_slot, w_begin + (i + 1) * BN, w_end, o_r)
                mbarrier.wait(kv_ready.index(st), (g // STAGES) & 1)
                fence_async_shared()
                s = warpgroup_mma(q_smem.index(0), kv_smem.index(2 * st).permute((1, 0)), s,
                                  use_acc=False, is_async=True)
                s = warpgroup_mma(q_smem.index(1), kv_smem.index(2 * st + 1).permute((1, 0)),
                                  s, is_async=True)
                s = warpgroup_mma_wait(0, deps=(s,))
                if i == n_steps - 1:  # the producer may load the next item's query
                    mbarrier.arrive(q_free, count=1)
                p, alpha, m, l_sum = online_softmax_step(s, valid, m, l_sum, scale_log2)
                mbarrier.wait(p_free.index(pb), ((g // 2) & 1) ^ 1)
                p_smem.index(pb).store(p.to(gl.bfloat16))
                alpha_smem.index(pb).store(alpha)
                fence_async_shared()
                mbarrier.arrive(p_ready.index(pb), count=1)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
                acc = acc * gl.expand_dims(alpha_o, 1)
                acc = warpgroup_mma(p_smem.index(pb), kv_smem.index(2 * st), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(st), count=1)
                g += 1
            if n_steps == 0:
                mbarrier.arrive(q_free, count=1)
            # The sums go to the value warpgroup in a buffer of two, once it has read what
            # item k - 2 left there (items of one step or none do not wait for it otherwise).
            mbarrier.wait(l_free.index(k % 2), ((k // 2) & 1) ^ 1)
            l_smem.index(k % 2).store(l_sum)
            mbarrier.arrive(fin.index(k % 2), count=1)
            if IS_SPLIT:
                o_h = head0 + gl.arange(0, HEADS, layout=row_s)
                seen = l_sum > 0
                lse = gl.where(seen, m + gl.log2(gl.where(seen, l_sum, 1.0)), float("-inf"))
                gl.store(part_lse + (i_t * NUM_SPLITS + i_s) * H + o_h, lse, mask=o_h < H)
            out, row_stride = _destination(o, part_o, i_t, i_s, H, stride_ot, stride_oh,
                                           NUM_SPLITS, IS_SPLIT)
            _store_half(acc, l_sum, out, row_stride, head0, H, 0, o_layout)
            k += 1

    @gluon.jit
    def _values(kv_smem, p_smem, alpha_smem, l_smem, kv_ready, kv_empty, p_ready, p_free, fin,
                l_free, o, part_o, H, W, stride_ot, stride_oh, NUM_ITEMS, NUM_SPLITS, STEPS_PER,
                EXTRA_STEPS, BN: gl.constexpr, IS_SPLIT: gl.constexpr):
        """The value warpgroup, per work item: P V_R per step, rescaled by the scores
        warpgroup's factors; the right half of the output."""
        STAGES: gl.constexpr = kv_ready.shape[0]
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF, 16])
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        g = 0
        k = 0
        for w in range(gl.program_id(0), NUM_ITEMS, gl.num_programs(0)):
            i_t, i_s, head0, w_begin, w_end, n_steps = _item(w, H, W, NUM_SPLITS, STEPS_PER,
                                                              EXTRA_STEPS, BN)
            acc = gl.zeros([HEADS, HALF], gl.float32, o_layout)
            for _ in range(n_steps):
                st = g % STAGES
                pb = g % 2
                mbarrier.wait(p_ready.index(pb), (g // 2) & 1)
                fence_async_shared()
                alpha = alpha_smem.index(pb).load(row_o)
                acc = acc * gl.expand_dims(alpha, 1)
                acc = warpgroup_mma(p_smem.index(pb), kv_smem.index(2 * st + 1), acc,
                                    is_async=True)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(p_free.index(pb), count=1)
                mbarrier.arrive(kv_empty.index(st), count=1)
                g += 1
            mbarrier.wait(fin.index(k % 2), (k // 2) & 1)
            row_sum = l_smem.index(k % 2).load(row_o)
            mbarrier.arrive(l_free.index(k % 2), count=1)
            out, row_stride = _destination(o, part_o, i_t, i_s, H, stride_ot, stride_oh,
                                           NUM_SPLITS, IS_SPLIT)
            _store_half(acc, row_sum, out, row_stride, head0, H, HALF, o_layout)
            k += 1

    @gluon.jit(do_not_specialize=("W", "NUM_ITEMS", "NUM_SPLITS", "STEPS_PER", "EXTRA_STEPS"))
    def sparse_mla_ws_kernel(q, latent, slots, o, part_o, part_lse, scale_log2, H, W,
                             stride_qt, stride_qh, stride_l, stride_s, stride_ot, stride_oh,
                             NUM_ITEMS, NUM_SPLITS, STEPS_PER, EXTRA_STEPS, BN: gl.constexpr,
                             STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
                             VALUE_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                             IS_SPLIT: gl.constexpr, HALF_LAYOUT: gl.constexpr,
                             P_LAYOUT: gl.constexpr):
        """Online-softmax attention of q[t, 64 heads] over latent[slots[t, split's range]]
        for the work items pid, pid + grid, ... (query x head block x split, NUM_ITEMS in all):
        the split ranges, outputs and partials of `triton_impl.sparse_mla_kernel`."""
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, HALF], HALF_LAYOUT)
        kv_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * STAGES, BN, HALF], HALF_LAYOUT)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [2, HEADS, BN], P_LAYOUT)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        alpha_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], vec_layout)
        l_smem = gl.allocate_shared_memory(gl.float32, [2, HEADS], vec_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_ready = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        q_free = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
        fin = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        l_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        p_free = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        # Every producer thread arrives once its own copies have landed.
        mbarrier.init(q_ready, count=PRODUCER_WARPS * 32)
        mbarrier.init(q_free, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(s), count=PRODUCER_WARPS * 32)
            mbarrier.init(kv_empty.index(s), count=2)  # both warpgroups read every slot
        for b in gl.static_range(2):
            mbarrier.init(p_ready.index(b), count=1)
            mbarrier.init(p_free.index(b), count=1)
            mbarrier.init(fin.index(b), count=1)
            mbarrier.init(l_free.index(b), count=1)
        fence_async_shared()
        gl.warp_specialize([
            (_scores, (slots, q_smem, kv_smem, p_smem, alpha_smem, l_smem, q_ready, q_free,
                       kv_ready, kv_empty, p_ready, p_free, fin, l_free, o, part_o, part_lse,
                       scale_log2, H, W, stride_s, stride_ot, stride_oh, NUM_ITEMS, NUM_SPLITS,
                       STEPS_PER, EXTRA_STEPS, BN, IS_SPLIT)),
            (_values, (kv_smem, p_smem, alpha_smem, l_smem, kv_ready, kv_empty, p_ready, p_free,
                       fin, l_free, o, part_o, H, W, stride_ot, stride_oh, NUM_ITEMS, NUM_SPLITS,
                       STEPS_PER, EXTRA_STEPS, BN, IS_SPLIT)),
            (_producer, (q, latent, slots, q_smem, kv_smem, q_ready, q_free, kv_ready, kv_empty,
                         H, W, stride_qt, stride_qh, stride_l, stride_s, NUM_ITEMS, NUM_SPLITS,
                         STEPS_PER, EXTRA_STEPS, BN, PRODUCER_WARPS)),
        ], [4, PRODUCER_WARPS], [VALUE_REGS, PRODUCER_REGS])


def kernel_call(q_lat, latent, slots, out, part_o, part_lse, scale_log2: float, plan,
                config: GluonSparseMlaConfig, sms: int) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, keyword arguments) of one `sparse_mla_ws_kernel` launch: a program per
    SM at most, each walking its work items (`config.persistent`; else one per item). Also
    what tools/gluon_check.py compiles."""
    num_queries, heads, _ = q_lat.shape
    bn = config.block_slots
    half_layout = gl.NVMMASharedLayout.get_default_for([bn, HALF], gl.bfloat16)
    p_layout = gl.NVMMASharedLayout.get_default_for([HEAD_BLOCK, bn], gl.bfloat16)
    items = num_queries * (heads // HEAD_BLOCK) * plan.num_splits
    grid = (min(items, sms) if config.persistent else items,)
    args = (q_lat, latent, slots, out, part_o, part_lse, scale_log2, heads, slots.shape[1],
            q_lat.stride(0), q_lat.stride(1), latent.stride(0), slots.stride(0), out.stride(0),
            out.stride(1), items, plan.num_splits, plan.steps_per_split, plan.extra_steps)
    kwargs = dict(BN=bn, STAGES=config.stages, PRODUCER_WARPS=config.producer_warps,
                  VALUE_REGS=config.value_regs,
                  PRODUCER_REGS=config.producer_regs, IS_SPLIT=plan.num_splits > 1,
                  HALF_LAYOUT=half_layout, P_LAYOUT=p_layout, num_warps=4,
                  maxnreg=config.max_regs)
    return grid, args, kwargs


def plan_for(q_lat: torch.Tensor, slots: torch.Tensor, config: GluonSparseMlaConfig,
             workspace: SparseMlaWorkspace | None = None) -> SplitPlan:
    """The split of this launch: plan.py's rule with the config's waves, at most what the
    workspace holds."""
    num_queries, heads, rank = q_lat.shape
    max_splits = workspace.max_splits(num_queries, heads, rank) if workspace else None
    return split_plan(num_queries, heads, slots.shape[1], config.block_slots,
                      num_sms(q_lat.device), config.split_config(), max_splits)


def sparse_mla(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *, scale: float,
               config: GluonSparseMlaConfig = GLUON_SPARSE_MLA_CONFIG,
               workspace: SparseMlaWorkspace | None = None) -> torch.Tensor:
    """`sparse_mla_ref` on SM90 (see `available`): the attention launch, and the combine
    launch of a split (combine_triton.py). Host work depends on shapes only (CUDA graphs)."""
    num_queries, heads, rank = q_lat.shape
    out = new_output(q_lat, latent, slots)
    if num_queries == 0:
        return out
    plan = plan_for(q_lat, slots, config, workspace)
    split = plan.num_splits > 1
    if split and workspace is None:
        # Sized for the split rule's narrowest steps: at least this plan's splits.
        workspace = SparseMlaWorkspace.create(num_queries, heads, rank, slots.shape[1],
                                              q_lat.device, num_sms(q_lat.device),
                                              config.split_config(), out.dtype)
    parts = (workspace.partial_out, workspace.partial_lse) if split else (out, out)
    grid, args, kwargs = kernel_call(q_lat, latent, slots, out, *parts, scale * LOG2E, plan,
                                     config, num_sms(q_lat.device))
    sparse_mla_ws_kernel[grid](*args, **kwargs)
    if split:
        combine(workspace, out, plan.num_splits, config.combine)
    return out


__all__ = ["GLUON_SPARSE_MLA_CONFIG", "GluonSparseMlaConfig", "available", "kernel_call",
           "plan_for", "serves", "sparse_mla"]
