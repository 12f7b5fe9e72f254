"""CPU routed experts on block-FP8 weights, streamed by Numba kernels (derivation in README.md).

Weights stay in their checkpoint layout (`[E, I, D]`, `[E, D, I]`, FP8 = 1 byte each, zero-copy
views of the torch tensors): every row block of one expert is already contiguous. Workers claim
TASK_ROWS-row chunks from an atomic counter, so a stalled or busy core does not hold up the
others, and each chunk is one contiguous run of bytes per matrix. With K thread pools
(`pools.py`) each pool owns a slice of every expert's rows, has its own counter and reads a
copy of the weights placed on its NUMA node.

`(int32(int8 q) << 20) & 0x87F00000`, read as fp32 bits, is exactly `e4m3(q) * 2**-120`
(subnormals included) - but those subnormals are fp32 denormals, which Intel cores handle with a
microcode assist per FMA; there `(int16(int8 q) << 7) & 0xBF80`, read as fp16 bits and
converted, gives `e4m3(q) * 2**-8` with no denormal (`DECODES`; `default_decode()` takes it on
Intel when the weights hold enough subnormal codes).
The block scale and the decode's power of two are folded into a per-(expert, row-block) copy of
the activations, so the inner loop is one FMA per weight and a row sum is rescaled once. The
inner loop is LLVM IR (`_make_dot_ir`): 512-bit vectors, four rows per pass, 32 bytes decoded by
one sign-extension to words and two shift+mask pairs (fp16: one shift+mask, a split into even
and odd words and two conversions), and a software prefetch into L2 that keeps enough DRAM
reads in flight (auto-vectorised Numba code cannot issue prefetches).

This module imports numba at the top; the package imports it lazily (`cpu_moe.__init__`).
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from typing import NamedTuple

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from glmflash.kernels.cpu_moe import pools
from glmflash.utils.env import cpu_moe_decode

logger = logging.getLogger(__name__)

BLOCK = 128
# tokens of one expert per pass over a row group; weight rows per pass
TOKEN_GROUP = 8
ROW_GROUP = 4
# rows of one work item taken by a worker from the shared task counter
TASK_ROWS = 128
# distance of the software prefetch ahead of each row's read position
PREFETCH_BYTES = 16384
# Two exact e4m3 decodes (`decode` argument of the kernels):
# DECODE_FP32_BITS: fp32 bits of (sign-extended byte << 20) & mask = s|0000eeee|mmm0.. =
#   e4m3 * 2^-120 - the fewest instructions, but e4m3 subnormals become fp32 denormals, and an
#   FMA on a denormal takes a microcode assist on Intel (uniformly random codes, 6% subnormal:
#   15x slower on the H200 host's Xeon). AMD Zen has no such penalty.
# DECODE_FP16: fp16 bits s|0eeee|mmm0000000 = e4m3 * 2^-8, converted by vcvtph2ps: never a
#   denormal; 8 vector operations per 32 weights instead of 5 (about 25% slower on a 2-core
#   Zen 4 at 1 token, where the decode is compute-bound).
DECODE_FP32_BITS, DECODE_FP16 = 0, 1
_E4M3_MASK = np.int32(-2014314496)  # 0x87F00000
# NOTE: (sign-extended byte << 7) & 0xBF80 = s|0eeee|mmm0000000 as fp16 bits: the extension puts
# the sign in bit 15, the mask clears the copy of it that lands in bit 14.
_F16_MASK = 0xBF80
# Activations are pre-scaled so a product never underflows: 2^-120 * 2^64 leaves row sums at
# 2^-56, undone once per sum; fp16 decodes need only 2^8.
_X_SCALE = (np.float32(2.0**64), np.float32(2.0**8))
_OUT_SCALE = (np.float32(2.0**56), np.float32(1.0))
# NOTE: per-worker accumulator rows are 128 bytes wide (TOKEN_GROUP floats used) so two workers
# never write one cache line.
_ACC_WIDTH = 32
# NOTE: pool p's task counter is task_counter[p * _COUNTER_STRIDE]: 16 int64 = 128 bytes, so
# no two counters (and no adjacent-line prefetch pair) share a cache line.
_COUNTER_STRIDE = 16
_FAST = {"reassoc", "contract"}

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_LANES = 16
_V_I32, _V_F32 = ir.VectorType(_I32, _LANES), ir.VectorType(_F32, _LANES)
_V32_I8, _V32_I16 = ir.VectorType(_I8, 2 * _LANES), ir.VectorType(ir.IntType(16), 2 * _LANES)
# weight bytes of one row consumed per loop iteration: two 32-byte pairs of 16-lane vectors
_STEP = 64
# llvm.prefetch locality 2 = prefetcht1 (into L2): measured 2x the DRAM rate of t0 or nta here
_PREFETCH_LOCALITY = 2


@intrinsic
def _bits_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as fp32 (no conversion)."""
    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, _I32)
        return builder.bitcast(value, _F32)
    return types.float32(bits), codegen


@intrinsic
def _f16_bits_as_f32(typingctx, bits):
    """The fp16 value whose bits are the low 16 of an integer, as fp32."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, _F32)
    return types.float32(bits), codegen


@intrinsic
def _fetch_add_ir(typingctx, counter, index, value):
    """Atomic `old = counter[index]; counter[index] += value; return old` on an int64 array."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
        raise TypingError(f"fetch-add wants an int64 array, got {counter}")

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        index = context.cast(builder, args[1], sig.args[1], types.int64)
        value = context.cast(builder, args[2], sig.args[2], types.int64)
        ptr = builder.gep(arr.data, [index])
        return builder.atomic_rmw("add", ptr, value, "monotonic")
    return types.int64(counter, index, value), codegen


@intrinsic
def _set_affinity_ir(typingctx, mask):
    """`sched_setaffinity(0, mask)`: pin the calling thread to the CPUs set in a uint64 mask."""
    if not (isinstance(mask, types.Array) and mask.dtype == types.uint64 and mask.ndim == 1):
        raise TypingError(f"affinity wants a 1-d uint64 mask, got {mask}")

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(_I32, [_I32, _I64, _I8.as_pointer()]),
            "sched_setaffinity")
        num_bytes = builder.mul(builder.extract_value(arr.shape, 0), ir.Constant(_I64, 8))
        data = builder.bitcast(arr.data, _I8.as_pointer())
        return builder.call(fn, [ir.Constant(_I32, 0), num_bytes, data])
    return types.int32(mask), codegen


@njit(cache=True, nogil=True, inline="always")
def _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks):
    """(counter slot, first row, end row, TASK_ROWS-row chunks) of worker wid's pool; pins the
    thread to the pool's CPUs when masks are given.

    NOTE: the pin is redone on every call, in the thread that runs worker wid, so it holds
    whichever thread (or threading layer) runs it; the caller restores the calling thread's mask.
    """
    pool = wid * (pool_rows.size - 1) // num_workers
    if cpu_masks.shape[0] > 0:
        _set_affinity_ir(cpu_masks[pool])
    first, end = pool_rows[pool], pool_rows[pool + 1]
    return pool * _COUNTER_STRIDE, first, end, (end - first + TASK_ROWS - 1) // TASK_ROWS


@njit(cache=True, nogil=True, inline="always")
def _chunk_rows_nb(task, chunks, first, end):
    """(matrix, first row, end row) of task number `task` over matrices of `chunks` chunks."""
    i = task // chunks
    row0 = first + (task - i * chunks) * TASK_ROWS
    return i, row0, min(row0 + TASK_ROWS, end)


@njit(cache=True, nogil=True, inline="always")
def _reset_counters_nb(pool_rows, task_counter):
    for p in range(pool_rows.size - 1):
        task_counter[p * _COUNTER_STRIDE] = 0


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _e4m3_nb(q, decode):
    """e4m3 byte -> its value scaled as the vector decode `decode` scales it."""
    q = np.int32(q)
    if decode == DECODE_FP16:
        return _f16_bits_as_f32((q << 7) & _F16_MASK)
    return _bits_as_f32((q << 20) & _E4M3_MASK)


def _ir_decode_pair_fp32_bits(builder, ptr):
    """32 e4m3 bytes at `ptr` -> (even, odd) <16 x float> of e4m3 * 2^-120.

    One sign-extension to 16-bit words gives dwords holding bytes 2i (low word) and 2i + 1 (high
    word); `<< 20` lines up the low byte and `<< 4` the high byte under the same mask.
    """
    raw = builder.load(builder.bitcast(ptr, _V32_I8.as_pointer()), align=1)
    words = builder.bitcast(builder.sext(raw, _V32_I16), _V_I32)
    mask = ir.Constant(_V_I32, [int(_E4M3_MASK)] * _LANES)
    even = builder.and_(builder.shl(words, ir.Constant(_V_I32, [20] * _LANES)), mask)
    odd = builder.and_(builder.shl(words, ir.Constant(_V_I32, [4] * _LANES)), mask)
    return builder.bitcast(even, _V_F32), builder.bitcast(odd, _V_F32)


def _ir_decode_pair_fp16(builder, ptr):
    """32 e4m3 bytes at `ptr` -> (even, odd) <16 x float> of e4m3 * 2^-8.

    Sign-extended to 16-bit words, one shift and mask make each word fp16 bits; the dwords hold
    bytes 2i (low word) and 2i + 1 (high word), split by truncation, then converted.
    """
    raw = builder.load(builder.bitcast(ptr, _V32_I8.as_pointer()), align=1)
    words = builder.sext(raw, _V32_I16)
    halves = builder.and_(builder.shl(words, ir.Constant(_V32_I16, [7] * 2 * _LANES)),
                          ir.Constant(_V32_I16, [_F16_MASK] * 2 * _LANES))
    dwords = builder.bitcast(halves, _V_I32)
    v_i16, v_f16 = ir.VectorType(ir.IntType(16), _LANES), ir.VectorType(ir.HalfType(), _LANES)
    even = builder.trunc(dwords, v_i16)
    odd = builder.trunc(builder.lshr(dwords, ir.Constant(_V_I32, [16] * _LANES)), v_i16)
    return tuple(builder.fpext(builder.bitcast(v, v_f16), _V_F32) for v in (even, odd))


def _ir_hsum(builder, vec):
    """Sum of the lanes of a <16 x float> by halving."""
    width = _LANES
    while width > 1:
        width //= 2
        lo = ir.Constant(ir.VectorType(_I32, width), list(range(width)))
        hi = ir.Constant(ir.VectorType(_I32, width), list(range(width, 2 * width)))
        vec = builder.fadd(builder.shuffle_vector(vec, vec, lo),
                           builder.shuffle_vector(vec, vec, hi))
    return builder.extract_element(vec, ir.Constant(_I32, 0))


def _ir_dot(context, builder, sig, args, num_rows, num_tokens, decode):
    """Emit the loop of `_make_dot_ir`; returns the num_rows * num_tokens sums, row-major."""
    w_arr = context.make_array(sig.args[0])(context, builder, args[0])
    xs_arr = context.make_array(sig.args[2])(context, builder, args[2])
    row = context.cast(builder, args[1], sig.args[1], types.int64)
    dist = context.cast(builder, args[3], sig.args[3], types.int64)
    k_len = builder.extract_value(w_arr.shape, 1)
    x_len = builder.extract_value(xs_arr.shape, 1)
    k_end = builder.and_(k_len, ir.Constant(_I64, -_STEP))
    w_rows = [builder.gep(w_arr.data, [builder.mul(builder.add(row, ir.Constant(_I64, r)), k_len)])
              for r in range(num_rows)]
    x_rows = [builder.gep(xs_arr.data, [builder.mul(ir.Constant(_I64, t), x_len)])
              for t in range(num_tokens)]
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V_F32, [_V_F32] * 3),
                                         "llvm.fma.v16f32")
    prefetch = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]),
        "llvm.prefetch.p0i8")
    pf_args = [ir.Constant(_I32, v) for v in (0, _PREFETCH_LOCALITY, 1)]
    decode_pair = _ir_decode_pair_fp16 if decode == DECODE_FP16 else _ir_decode_pair_fp32_bits
    # independent FMA chains: at least four, so the FMA latency never bounds a 1x1 dot
    num_sets = max(1, 4 // (num_rows * num_tokens))
    zero = ir.Constant(_V_F32, [0.0] * _LANES)
    entry = builder.block
    loop = builder.append_basic_block("fp8dot.loop")
    done = builder.append_basic_block("fp8dot.done")
    builder.cbranch(builder.icmp_signed(">", k_end, ir.Constant(_I64, 0)), loop, done)

    builder.position_at_end(loop)
    k = builder.phi(_I64)
    accs = [[[builder.phi(_V_F32) for _ in range(num_sets)] for _ in range(num_tokens)]
            for _ in range(num_rows)]
    new = [[list(a) for a in acc_r] for acc_r in accs]
    for w_row in w_rows:
        builder.call(prefetch, [builder.gep(w_row, [builder.add(k, dist)]), *pf_args])
    for step in range(0, _STEP // _LANES, 2):
        k_s = builder.add(k, ir.Constant(_I64, step * _LANES))
        k_odd = builder.add(k_s, ir.Constant(_I64, _LANES))
        xvs = [[builder.load(builder.bitcast(builder.gep(x_row, [k_i]), _V_F32.as_pointer()),
                             align=4) for k_i in (k_s, k_odd)] for x_row in x_rows]
        for r, w_row in enumerate(w_rows):
            for half, wv in enumerate(decode_pair(builder, builder.gep(w_row, [k_s]))):
                i = (step + half) % num_sets
                for t in range(num_tokens):
                    new[r][t][i] = builder.call(fma, [wv, xvs[t][half], new[r][t][i]])
    k_next = builder.add(k, ir.Constant(_I64, _STEP))
    builder.cbranch(builder.icmp_signed("<", k_next, k_end), loop, done)
    k.add_incoming(ir.Constant(_I64, 0), entry)
    k.add_incoming(k_next, loop)

    builder.position_at_end(done)
    finals = []
    for r in range(num_rows):
        for t in range(num_tokens):
            sets = []
            for acc, acc_new in zip(accs[r][t], new[r][t], strict=True):
                acc.add_incoming(zero, entry)
                acc.add_incoming(acc_new, loop)
                final = builder.phi(_V_F32)
                final.add_incoming(zero, entry)
                final.add_incoming(acc_new, loop)
                sets.append(final)
            finals.append(sets)
    sums = []
    for sets in finals:
        total = sets[0]
        for other in sets[1:]:
            total = builder.fadd(total, other)
        sums.append(_ir_hsum(builder, total))
    return sums


def _make_dot_ir(num_rows, num_tokens):
    """Intrinsic `(w [N, K] int8 C, row, xs [T, >=K] f32 C, prefetch_bytes, decode) -> tuple of
    sums`.

    Sum r * num_tokens + t is `sum_k e4m3(w[row + r, k]) * x_t[k]` times 2^-120
    (DECODE_FP32_BITS) or 2^-8 (DECODE_FP16) over the first `K - K % 64` columns (the caller adds
    the tail), where xs holds each activation row in the even/odd layout of `_scale_row_nb`.
    Each of the num_rows streams prefetches `prefetch_bytes` ahead of its read position. Both
    decodes are emitted, behind one branch on `decode`.
    """
    ret = types.UniTuple(types.float32, num_rows * num_tokens)

    def typer(typingctx, w, row, xs, prefetch_bytes, decode):
        is_w = isinstance(w, types.Array) and w.dtype == types.int8 and w.ndim == 2
        is_xs = isinstance(xs, types.Array) and xs.dtype == types.float32 and xs.ndim == 2
        if not (is_w and is_xs and w.layout == "C" and xs.layout == "C"):
            raise TypingError(f"fp8 dot wants C-contiguous int8 [N, K], f32 [T, K]: {w}, {xs}")

        def codegen(context, builder, sig, args):
            use_fp16 = builder.icmp_signed(
                "==", context.cast(builder, args[4], sig.args[4], types.int64),
                ir.Constant(_I64, DECODE_FP16))
            branches = []
            with builder.if_else(use_fp16) as (fp16, fp32_bits):
                for arm, decode_kind in ((fp16, DECODE_FP16), (fp32_bits, DECODE_FP32_BITS)):
                    with arm:
                        sums = _ir_dot(context, builder, sig, args, num_rows, num_tokens,
                                       decode_kind)
                        branches.append((sums, builder.block))
            merged = []
            for i in range(num_rows * num_tokens):
                phi = builder.phi(_F32)
                for sums, block in branches:
                    phi.add_incoming(sums[i], block)
                merged.append(phi)
            return context.make_tuple(builder, ret, merged)
        return ret(w, row, xs, prefetch_bytes, decode), codegen

    typer.__name__ = f"_dot_{num_rows}x{num_tokens}_ir"
    return intrinsic(typer)


_dot_4x4_ir = _make_dot_ir(4, 4)
_dot_4x2_ir = _make_dot_ir(4, 2)
_dot_4x1_ir = _make_dot_ir(4, 1)
_dot_1x1_ir = _make_dot_ir(1, 1)


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _rows_dot_nb(w, n, num_rows, xs, num_tokens, acc, decode):
    """acc[r, t] = sum_k e4m3(w[n + r, k]) * x_t[k] (times the decode's factor) for
    r < num_rows, t < num_tokens.

    w [N, K] int8; xs [TB, >=K] f32 (rows from `_scale_row_nb`); acc [ROW_GROUP, >=TB] f32.
    """
    if num_rows == ROW_GROUP:
        t = 0
        while t < num_tokens:
            if num_tokens - t >= 4:
                sums = _dot_4x4_ir(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(16):
                    acc[i // 4, t + i % 4] = sums[i]
                t += 4
            elif num_tokens - t >= 2:
                sums2 = _dot_4x2_ir(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(8):
                    acc[i // 2, t + i % 2] = sums2[i]
                t += 2
            else:
                sums1 = _dot_4x1_ir(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(4):
                    acc[i, t] = sums1[i]
                t += 1
    else:
        for r in range(num_rows):
            for t in range(num_tokens):
                acc[r, t] = _dot_1x1_ir(w, n + r, xs[t:], PREFETCH_BYTES, decode)[0]
    k_len = w.shape[1]
    for r in range(num_rows):
        for t in range(num_tokens):
            tail = np.float32(0.0)
            for k in range(k_len - k_len % 64, k_len):
                tail += _e4m3_nb(w[n + r, k], decode) * xs[t, k]
            acc[r, t] += tail


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _scale_row_nb(x, scales, block, out, x_scale):
    """out = x[k] * scales[k // block] * x_scale in the layout the fp8 dot reads; x [K].

    Below K - K % 64, each 32-wide chunk holds its even elements, then its odd ones (the order in
    which `_ir_decode_pair_*` yield weights); the tail keeps the natural order. block % 32 == 0.
    """
    size = x.size
    k_end = size - size % 64
    for c in range(0, k_end, 32):
        s = scales[c // block] * x_scale
        xc = x[c:c + 32]
        oc = out[c:c + 32]
        for i in range(16):
            oc[i] = xc[2 * i] * s
            oc[16 + i] = xc[2 * i + 1] * s
    for k in range(k_end, size):
        out[k] = x[k] * (scales[k // block] * x_scale)


@njit(cache=True, nogil=True)
def _group_nb(topk_ids, topk_weights, counts, hit_ids, pair_offsets, pair_token_ids,
              pair_weights):
    """Counting sort of the (token, slot) pairs by expert; returns the number of experts hit.

    Fills hit_ids[:n] (ascending), pair_offsets[:n + 1] (CSR into the pair arrays),
    pair_token_ids and pair_weights (one entry per pair, grouped by expert). Pairs with a
    negative id are skipped (experts computed elsewhere).
    """
    num_experts = counts.size
    counts[:] = 0
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = topk_ids[t, j]
            if e >= num_experts:
                raise ValueError("topk_ids holds an expert id out of range")
            if e >= 0:
                counts[e] += 1
    num_hit = 0
    offset = 0
    for e in range(num_experts):
        if counts[e] > 0:
            hit_ids[num_hit] = e
            pair_offsets[num_hit] = offset
            offset += counts[e]
            # counts[e] becomes the write cursor of expert e
            counts[e] = pair_offsets[num_hit]
            num_hit += 1
    pair_offsets[num_hit] = offset
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = topk_ids[t, j]
            if e < 0:
                continue
            p = counts[e]
            counts[e] = p + 1
            pair_token_ids[p] = t
            pair_weights[p] = topk_weights[t, j]
    return num_hit


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _swiglu_nb(a, b, swiglu_limit, out_scale):
    """silu(min(a, L)) * clip(b, -L, L) from two raw row sums (to multiply by out_scale)."""
    a = min(a * out_scale, swiglu_limit)
    b = max(min(b * out_scale, swiglu_limit), -swiglu_limit)
    return a / (np.float32(1.0) + np.exp(-a)) * b


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _gate_up_rows_nb(x, gate_w, gate_s, up_w, up_s, e, row0, row1, p0, p1, pair_token_ids,
                     swiglu_limit, decode, block, xs, acc, h):
    """h[p, row0:row1] for pairs p0..p1 of expert e; rows lie in one row block."""
    rb = row0 // block
    x_scale, out_scale = _X_SCALE[decode], _OUT_SCALE[decode]
    gw = gate_w[e]
    uw = up_w[e]
    for c in range(p0, p1, TOKEN_GROUP):
        num_tokens = min(TOKEN_GROUP, p1 - c)
        for j in range(num_tokens):
            xt = x[pair_token_ids[c + j]]
            _scale_row_nb(xt, gate_s[e, rb], block, xs[0, j], x_scale)
            _scale_row_nb(xt, up_s[e, rb], block, xs[1, j], x_scale)
        for n in range(row0, row1, ROW_GROUP):
            num_rows = min(ROW_GROUP, row1 - n)
            _rows_dot_nb(gw, n, num_rows, xs[0], num_tokens, acc[0], decode)
            _rows_dot_nb(uw, n, num_rows, xs[1], num_tokens, acc[1], decode)
            for r in range(num_rows):
                for j in range(num_tokens):
                    h[c + j, n + r] = _swiglu_nb(acc[0, r, j], acc[1, r, j], swiglu_limit,
                                                 out_scale)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _gate_up_nb(x, gate_w, gate_s, up_w, up_s, hit_ids, pair_offsets, pair_token_ids,
                swiglu_limit, decode, block, pool_rows, cpu_masks, scratch, acc, task_counter,
                trace, h):
    """h[p] = silu(min(a, L)) * clip(b, -L, L) for every pair p, a/b = x W_gate/up^T of its expert.

    x [T, D] f32; *_w [E, I, D] int8 (e4m3 bytes); *_s [E, ceil(I/b), ceil(D/b)] f32;
    decode DECODE_FP32_BITS or DECODE_FP16;
    pool_rows [K + 1] int64 (pool p owns rows pool_rows[p]..pool_rows[p + 1] of every expert);
    cpu_masks [K or 0, words] uint64; scratch [workers, 2, TB, >=D] f32;
    acc [workers, 2, ROW_GROUP, >=TB] f32; task_counter [>=16 K] int64;
    trace [hit, I] or [0, 0] int64 (debug: worker of each row); h [pairs, I] f32 (output).
    Tasks are TASK_ROWS-row chunks of one hit expert within a pool's rows, in memory order; a
    worker takes the next task of its own pool.
    """
    num_workers = scratch.shape[0]
    _reset_counters_nb(pool_rows, task_counter)
    for wid in prange(num_workers):
        slot, first, end, chunks = _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks)
        num_tasks = hit_ids.size * chunks
        task = _fetch_add_ir(task_counter, slot, 1)
        while task < num_tasks:
            i, row0, row_end = _chunk_rows_nb(task, chunks, first, end)
            if trace.shape[0] > 0:
                trace[i, row0:row_end] = wid
            while row0 < row_end:
                row1 = min(row0 // block * block + block, row_end)
                _gate_up_rows_nb(x, gate_w, gate_s, up_w, up_s, hit_ids[i], row0, row1,
                                 pair_offsets[i], pair_offsets[i + 1], pair_token_ids,
                                 swiglu_limit, decode, block, scratch[wid], acc[wid], h)
                row0 = row1
            task = _fetch_add_ir(task_counter, slot, 1)


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _down_rows_nb(h, down_w, down_s, e, row0, row1, p0, p1, pair_token_ids, pair_weights,
                  decode, block, xs, acc, out):
    """out[token, row0:row1] += weight * h[p] W_down[e]^T for pairs p0..p1; one row block."""
    rb = row0 // block
    x_scale, out_scale = _X_SCALE[decode], _OUT_SCALE[decode]
    dw = down_w[e]
    for c in range(p0, p1, TOKEN_GROUP):
        num_tokens = min(TOKEN_GROUP, p1 - c)
        for j in range(num_tokens):
            _scale_row_nb(h[c + j], down_s[e, rb], block, xs[j], x_scale)
        for n in range(row0, row1, ROW_GROUP):
            num_rows = min(ROW_GROUP, row1 - n)
            _rows_dot_nb(dw, n, num_rows, xs, num_tokens, acc, decode)
            for r in range(num_rows):
                for j in range(num_tokens):
                    scale = pair_weights[c + j] * out_scale
                    out[pair_token_ids[c + j], n + r] += scale * acc[r, j]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _down_nb(h, down_w, down_s, hit_ids, pair_offsets, pair_token_ids, pair_weights, decode,
             block, pool_rows, cpu_masks, scratch, acc, task_counter, trace, out):
    """out[t] += sum over t's pairs p of weight_p * h[p] W_down[e_p]^T.

    h [pairs, I] f32; down_w [E, D, I] int8; down_s [E, ceil(D/b), ceil(I/b)] f32;
    pool_rows [K + 1] int64 (pool p owns output rows pool_rows[p]..pool_rows[p + 1]);
    cpu_masks [K or 0, words] uint64; scratch [workers, 2, TB, >=I] f32;
    acc [workers, 2, ROW_GROUP, >=TB] f32; task_counter [>=16 K] int64;
    trace [D] or [0] int64 (debug: worker of each output row); out [T, D] f32 (accumulated).
    A task is a TASK_ROWS-row chunk of its pool's output rows over every hit expert, so no two
    workers write one element and pools need no partial sums.
    """
    num_workers = scratch.shape[0]
    _reset_counters_nb(pool_rows, task_counter)
    for wid in prange(num_workers):
        slot, first, end, num_tasks = _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks)
        task = _fetch_add_ir(task_counter, slot, 1)
        while task < num_tasks:
            _, row_begin, row_end = _chunk_rows_nb(task, num_tasks, first, end)
            if trace.shape[0] > 0:
                trace[row_begin:row_end] = wid
            for i in range(hit_ids.size):
                row0 = row_begin
                while row0 < row_end:
                    row1 = min(row0 // block * block + block, row_end)
                    _down_rows_nb(h, down_w, down_s, hit_ids[i], row0, row1, pair_offsets[i],
                                  pair_offsets[i + 1], pair_token_ids, pair_weights, decode,
                                  block, scratch[wid, 0], acc[wid, 0], out)
                    row0 = row1
            task = _fetch_add_ir(task_counter, slot, 1)


@njit(cache=True, nogil=True, parallel=True)
def _place_rows_nb(src, pool_rows, cpu_masks, task_counter, num_workers, dst):
    """dst = src [E, N, K] int8, each pool's rows copied by that pool's workers (pinned first),
    so the first touch of every page comes from the node that will read it.
    """
    num_experts = src.shape[0]
    _reset_counters_nb(pool_rows, task_counter)
    for wid in prange(num_workers):
        slot, first, end, chunks = _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks)
        task = _fetch_add_ir(task_counter, slot, 1)
        while task < num_experts * chunks:
            e, row0, row1 = _chunk_rows_nb(task, chunks, first, end)
            dst[e, row0:row1] = src[e, row0:row1]
            task = _fetch_add_ir(task_counter, slot, 1)


DECODES = {"fp32-bits": DECODE_FP32_BITS, "fp16": DECODE_FP16}


# Share of subnormal codes from which Intel cores take the fp16 decode. On the H200 host's Xeon
# (16 threads, release shapes): at 0.01% (weights quantised like a checkpoint) the fp32 bits
# streamed 0.89 / 0.85 / 0.95 of the read probe at 1 / 4 / 16 tokens against fp16's 0.68 / 0.93 /
# 0.97; at 6% (uniform codes) 0.06. An assist hits every 16-lane FMA holding a denormal, so
# 1 - (1 - p)^16 of them: ~0.3% of FMAs at 2e-4, where its ~150 cycles start to cost more than
# the fp16 decode's extra operations.
SUBNORMAL_FP16_SHARE = 2e-4
SUBNORMAL_SAMPLE = 1 << 22


def subnormal_share(*weights: torch.Tensor) -> float:
    """Share of subnormal e4m3 codes (exponent 0, mantissa not 0) in evenly spaced samples of at
    most SUBNORMAL_SAMPLE bytes per weight."""
    hits = total = 0
    for weight in weights:
        flat = weight.reshape(-1).view(torch.uint8)
        # NOTE: an odd step walks every column of power-of-two-wide rows, not a few of them.
        step = max(1, flat.numel() // SUBNORMAL_SAMPLE) | 1
        sample = flat[::step][:SUBNORMAL_SAMPLE].numpy()
        hits += int(np.count_nonzero(((sample & 0x78) == 0) & ((sample & 0x07) != 0)))
        total += sample.size
    return hits / max(total, 1)


def _is_intel() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return "intel" in platform.processor().lower()


def default_decode(*weights: torch.Tensor) -> str:
    """GLMFLASH_CPU_MOE_DECODE if set; else "fp16" on Intel when the weights hold at least
    SUBNORMAL_FP16_SHARE subnormal codes (their fp32 denormals take microcode assists there),
    and "fp32-bits" otherwise - the fewer operations."""
    chosen = cpu_moe_decode()
    if chosen:
        return chosen
    if _is_intel() and (not weights or subnormal_share(*weights) >= SUBNORMAL_FP16_SHARE):
        return "fp16"
    return "fp32-bits"


def _fp8_bytes(weight: torch.Tensor) -> np.ndarray:
    """Zero-copy int8 view of an FP8 tensor's bytes."""
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    return weight.view(torch.uint8).numpy().view(np.int8)


class WorkerTrace(NamedTuple):
    """Debug record of one forward (`NumbaMoeExperts.record_workers`): which worker computed
    each row."""

    hit_ids: np.ndarray
    """[hit] experts hit, in the order of the rows of `gate_up`."""
    gate_up: np.ndarray
    """[hit, I] int64: worker of each gate/up row of each hit expert."""
    down: np.ndarray
    """[D] int64: worker of each output row."""


_NO_TRACE_2D = np.zeros((0, 0), np.int64)
_NO_TRACE_1D = np.zeros(0, np.int64)


def _check_shapes(gate_w, gate_s, up_w, up_s, down_w, down_s, block: int) -> None:
    num_experts, inter, hidden = gate_w.shape
    shape_gu = (num_experts, -(-inter // block), -(-hidden // block))
    shape_down = (num_experts, -(-hidden // block), -(-inter // block))
    if up_w.shape != gate_w.shape or down_w.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert shapes differ: {gate_w.shape}, {up_w.shape}, {down_w.shape}")
    if gate_s.shape != shape_gu or up_s.shape != shape_gu or down_s.shape != shape_down:
        raise ValueError(f"scale shapes {gate_s.shape}, {up_s.shape}, {down_s.shape} do not "
                         f"fit block {block}")
    if block % 32:
        raise ValueError(f"block {block} must be a multiple of 32")


@functools.cache
def _log_layout(num_pools: int, threads_per_pool: tuple[int, ...], cpus: str, layer: str) -> None:
    logger.info("CPU experts: %d pool(s), threads per pool %s, %s, numba threading layer %s",
                num_pools, "/".join(map(str, threads_per_pool)), cpus, layer)


class NumbaMoeExperts:
    """Routed experts of one MoE layer on CPU.

    With one pool the weights are borrowed (zero-copy). With `num_pools` K > 1, K thread pools
    each own a slice of every expert's rows (`pools.py`), and each weight is copied once into a
    fresh allocation, every pool's rows by that pool's threads, so the pages sit on the pool's
    NUMA node (first touch). `weight_tensors` are then those copies: the caller should hold them
    in place of the originals, or the memory is doubled.

    NOTE: the scratch buffers are per instance, so one forward at a time per instance.
    """

    def __init__(self, gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor,
                 up_s: torch.Tensor, down_w: torch.Tensor, down_s: torch.Tensor, *,
                 swiglu_limit: float, num_threads: int | None = None, num_pools: int = 1,
                 pool_cpus: list[list[int]] | None = None, block: int = BLOCK,
                 decode: str | None = None):
        """`pool_cpus`: CPUs each pool's threads are pinned to (default: the NUMA nodes, see
        `pools.pool_cpus`; unpinned when they do not split into `num_pools`). `decode`: "fp16"
        or "fp32-bits" (default: `default_decode()` of these weights)."""
        _check_shapes(gate_w, gate_s, up_w, up_s, down_w, down_s, block)
        self.num_experts, self.inter, self.hidden = gate_w.shape
        self.num_threads = num_threads or numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(self.num_threads)
        self.swiglu_limit = float(swiglu_limit)
        self.block = block
        self.decode_name = decode or default_decode(gate_w, up_w, down_w)
        if self.decode_name not in DECODES:
            raise ValueError(f"unknown e4m3 decode {self.decode_name!r}; expected one of "
                             f"{tuple(DECODES)}")
        self.decode = DECODES[self.decode_name]
        self._init_pools(num_pools, pool_cpus)
        self.weight_tensors = (self._place(gate_w, self._gate_up_rows),
                               self._place(up_w, self._gate_up_rows),
                               self._place(down_w, self._down_rows))
        """The FP8 weights read: the arguments with one pool, their placed copies with several."""
        # zero-copy views: weight_tensors keeps their storage alive
        self.gate_w, self.up_w, self.down_w = (_fp8_bytes(w) for w in self.weight_tensors)
        self.gate_s, self.up_s, self.down_s = (
            np.ascontiguousarray(s.float().numpy()) for s in (gate_s, up_s, down_s))
        width = max(self.hidden, self.inter)
        self._scratch = np.zeros((self.num_threads, 2, TOKEN_GROUP, width), np.float32)
        self._acc = np.zeros((self.num_threads, 2, ROW_GROUP, _ACC_WIDTH), np.float32)
        self._counts = np.zeros(self.num_experts, np.int64)
        self.record_workers = False
        """Debug: when True, each forward leaves a `WorkerTrace` in `worker_trace`."""
        self.worker_trace: WorkerTrace | None = None
        self._reserve(8)

    def _init_pools(self, num_pools: int, pool_cpus: list[list[int]] | None) -> None:
        if not 1 <= num_pools <= self.num_threads:
            raise ValueError(f"num_pools {num_pools} must be between 1 and num_threads "
                             f"({self.num_threads}): every pool needs a thread")
        pool_cpus = pools.pool_cpus(num_pools) if pool_cpus is None else pool_cpus
        if pool_cpus is not None and (len(pool_cpus) != num_pools or not all(pool_cpus)):
            raise ValueError(f"pool_cpus {pool_cpus} must list some CPUs for each of the "
                             f"{num_pools} pools")
        self.num_pools, self.pool_cpus = num_pools, pool_cpus
        self._gate_up_rows = pools.split_rows(self.inter, num_pools, self.block, ROW_GROUP)
        self._down_rows = pools.split_rows(self.hidden, num_pools, self.block, ROW_GROUP)
        self._cpu_masks = pools.cpu_masks(pool_cpus)
        self._task_counter = np.zeros(num_pools * _COUNTER_STRIDE, np.int64)

    def _place(self, weight: torch.Tensor, pool_rows: np.ndarray) -> torch.Tensor:
        """The weight itself with one pool, else a copy whose rows each pool's threads wrote."""
        if self.num_pools == 1:
            return weight
        src = _fp8_bytes(weight)
        # a fresh large allocation is mmap-backed: no page exists until the copy touches it
        placed = torch.empty_like(weight, memory_format=torch.contiguous_format)
        with pools.keeping_thread_affinity(self.pool_cpus is not None):
            _place_rows_nb(src, pool_rows, self._cpu_masks, self._task_counter,
                           self.num_threads, _fp8_bytes(placed))
        return placed

    def _reserve(self, num_pairs: int) -> None:
        """Grow the per-pair buffers (pair lists and the hidden activations h) to num_pairs."""
        if getattr(self, "_h", None) is not None and self._h.shape[0] >= num_pairs:
            return
        self._hit_ids = np.zeros(num_pairs, np.int64)
        self._pair_offsets = np.zeros(num_pairs + 1, np.int64)
        self._pair_token_ids = np.zeros(num_pairs, np.int64)
        self._pair_weights = np.zeros(num_pairs, np.float32)
        self._h = np.zeros((num_pairs, self.inter), np.float32)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D], topk_ids [T, k] int (< 0: skip the pair), topk_weights [T, k] -> [T, D]
        fp32 (or into `out`)."""
        num_tokens = x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x {tuple(x.shape)} does not match hidden {self.hidden}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
            raise ValueError(f"topk shapes {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        if out is None:
            out = torch.zeros(num_tokens, self.hidden, dtype=torch.float32)
        else:
            assert out.shape == (num_tokens, self.hidden) and out.dtype == torch.float32
            assert out.is_contiguous()
            out.zero_()
        if numba.get_num_threads() != self.num_threads:
            numba.set_num_threads(self.num_threads)
        x_np = x.detach().to(torch.float32).contiguous().numpy()
        ids = topk_ids.detach().to(torch.int64).contiguous().numpy()
        weights = topk_weights.detach().to(torch.float32).contiguous().numpy()
        self._reserve(ids.size)
        num_hit = _group_nb(ids, weights, self._counts, self._hit_ids, self._pair_offsets,
                            self._pair_token_ids, self._pair_weights)
        if num_hit:
            self._run(x_np, self._hit_ids[:num_hit], out.numpy())
        return out

    def _run(self, x_np: np.ndarray, hit_ids: np.ndarray, out_np: np.ndarray) -> None:
        """Both parallel phases over the grouped pairs."""
        trace = WorkerTrace(hit_ids.copy(), np.full((hit_ids.size, self.inter), -1),
                            np.full(self.hidden, -1)) if self.record_workers else None
        with pools.keeping_thread_affinity(self.pool_cpus is not None):
            _gate_up_nb(x_np, self.gate_w, self.gate_s, self.up_w, self.up_s, hit_ids,
                        self._pair_offsets, self._pair_token_ids, np.float32(self.swiglu_limit),
                        self.decode, self.block, self._gate_up_rows, self._cpu_masks, self._scratch,
                        self._acc, self._task_counter,
                        _NO_TRACE_2D if trace is None else trace.gate_up, self._h)
            _down_nb(self._h, self.down_w, self.down_s, hit_ids, self._pair_offsets,
                     self._pair_token_ids, self._pair_weights, self.decode, self.block,
                     self._down_rows, self._cpu_masks, self._scratch, self._acc,
                     self._task_counter,
                     _NO_TRACE_1D if trace is None else trace.down, out_np)
        self.worker_trace = trace

    def warmup(self) -> None:
        """Compile (or load from cache) every kernel with one token on expert 0; log the pools
        once per process."""
        x = torch.zeros(1, self.hidden, dtype=torch.float32)
        self.forward(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))
        threads = np.bincount(pools.pool_of_workers(self.num_threads, self.num_pools))
        _log_layout(self.num_pools, tuple(int(t) for t in threads),
                    pools.describe_pinning(self.num_pools, self.pool_cpus),
                    numba.threading_layer())
