"""The LLVM IR the CPU expert kernels need and Numba cannot express: bit casts, an atomic
fetch-add, `sched_setaffinity`, and the fp8 dot product's inner loop (README.md, "Kernel
structure").

The dot (`make_dot`) uses 512-bit vectors, several rows and tokens per pass, 32 bytes decoded by
one sign-extension to words and two shift+mask pairs (fp16: one shift+mask, a split into even
and odd words and two conversions), and a software prefetch into L2 that keeps enough DRAM
reads in flight (auto-vectorised Numba code cannot issue prefetches).

NOTE: Numba's on-disk cache of the kernels that call these (numba_kernels.py) is keyed on that
file only: after editing this one, touch numba_kernels.py so the kernels are compiled again.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

# The two exact e4m3 decodes (README.md, "Derivation"):
# DECODE_FP32_BITS: fp32 bits of (sign-extended byte << 20) & E4M3_MASK = s|0000eeee|mmm0.. =
#   e4m3 * 2^-120, the fewest instructions; e4m3 subnormals become fp32 denormals.
# DECODE_FP16: fp16 bits s|0eeee|mmm0000000 = e4m3 * 2^-8, converted by vcvtph2ps: never a
#   denormal, at 8 vector operations per 32 weights instead of 5.
DECODE_FP32_BITS, DECODE_FP16 = 0, 1
E4M3_MASK = np.int32(-2014314496)  # 0x87F00000
# NOTE: (sign-extended byte << 7) & 0xBF80 = s|0eeee|mmm0000000 as fp16 bits: the extension puts
# the sign in bit 15, the mask clears the copy of it that lands in bit 14.
F16_MASK = 0xBF80

_I8, _I32, _I64, _F32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
_LANES = 16
_V_I32, _V_F32 = ir.VectorType(_I32, _LANES), ir.VectorType(_F32, _LANES)
_V32_I8, _V32_I16 = ir.VectorType(_I8, 2 * _LANES), ir.VectorType(ir.IntType(16), 2 * _LANES)
# weight bytes of one row consumed per loop iteration: two 32-byte pairs of 16-lane vectors
STEP = 64
# llvm.prefetch locality 2 = prefetcht1 (into L2), the fastest of the three (README.md,
# "Measured")
_PREFETCH_LOCALITY = 2


@intrinsic
def bits_as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as fp32 (no conversion)."""
    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, _I32)
        return builder.bitcast(value, _F32)
    return types.float32(bits), codegen


@intrinsic
def f16_bits_as_f32(typingctx, bits):
    """The fp16 value whose bits are the low 16 of an integer, as fp32."""
    def codegen(context, builder, signature, args):
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, _F32)
    return types.float32(bits), codegen


def _atomic_rmw(op: str, ordering: str, name: str, doc: str):
    """An intrinsic `(int64 array, index, value) -> old value` doing LLVM's atomicrmw `op`."""
    def typer(typingctx, counter, index, value):
        if not (isinstance(counter, types.Array) and counter.dtype == types.int64):
            raise TypingError(f"{name} wants an int64 array, got {counter}")

        def codegen(context, builder, sig, args):
            arr = context.make_array(sig.args[0])(context, builder, args[0])
            index = context.cast(builder, args[1], sig.args[1], types.int64)
            value = context.cast(builder, args[2], sig.args[2], types.int64)
            ptr = builder.gep(arr.data, [index])
            return builder.atomic_rmw(op, ptr, value, ordering)
        return types.int64(counter, index, value), codegen

    typer.__name__, typer.__doc__ = name, doc
    return intrinsic(typer)


fetch_add = _atomic_rmw("add", "monotonic", "fetch_add",
                        "Atomic `old = counter[index]; counter[index] += value; return old`.")
fetch_add_seq_cst = _atomic_rmw("add", "seq_cst", "fetch_add_seq_cst",
                                "`fetch_add`, sequentially consistent (adding 0: a load).")
exchange_seq_cst = _atomic_rmw("xchg", "seq_cst", "exchange_seq_cst",
                               "Sequentially consistent `old = arr[index]; arr[index] = value`.")


@intrinsic
def set_affinity(typingctx, mask):
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


def _ir_decode_pair_fp32_bits(builder, ptr):
    """32 e4m3 bytes at `ptr` -> (even, odd) <16 x float> of e4m3 * 2^-120.

    One sign-extension to 16-bit words gives dwords holding bytes 2i (low word) and 2i + 1 (high
    word); `<< 20` lines up the low byte and `<< 4` the high byte under the same mask.
    """
    raw = builder.load(builder.bitcast(ptr, _V32_I8.as_pointer()), align=1)
    words = builder.bitcast(builder.sext(raw, _V32_I16), _V_I32)
    mask = ir.Constant(_V_I32, [int(E4M3_MASK)] * _LANES)
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
                          ir.Constant(_V32_I16, [F16_MASK] * 2 * _LANES))
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
    """Emit the loop of `make_dot`; returns the num_rows * num_tokens sums, row-major."""
    w_arr = context.make_array(sig.args[0])(context, builder, args[0])
    xs_arr = context.make_array(sig.args[2])(context, builder, args[2])
    row = context.cast(builder, args[1], sig.args[1], types.int64)
    dist = context.cast(builder, args[3], sig.args[3], types.int64)
    k_len = builder.extract_value(w_arr.shape, 1)
    x_len = builder.extract_value(xs_arr.shape, 1)
    k_end = builder.and_(k_len, ir.Constant(_I64, -STEP))
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
    for step in range(0, STEP // _LANES, 2):
        k_s = builder.add(k, ir.Constant(_I64, step * _LANES))
        k_odd = builder.add(k_s, ir.Constant(_I64, _LANES))
        xvs = [[builder.load(builder.bitcast(builder.gep(x_row, [k_i]), _V_F32.as_pointer()),
                             align=4) for k_i in (k_s, k_odd)] for x_row in x_rows]
        for r, w_row in enumerate(w_rows):
            for half, wv in enumerate(decode_pair(builder, builder.gep(w_row, [k_s]))):
                i = (step + half) % num_sets
                for t in range(num_tokens):
                    new[r][t][i] = builder.call(fma, [wv, xvs[t][half], new[r][t][i]])
    k_next = builder.add(k, ir.Constant(_I64, STEP))
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


def make_dot(num_rows, num_tokens):
    """Intrinsic `(w [N, K] int8 C, row, xs [T, >=K] f32 C, prefetch_bytes, decode) -> tuple of
    sums`.

    Sum r * num_tokens + t is `sum_k e4m3(w[row + r, k]) * x_t[k]` times 2^-120
    (DECODE_FP32_BITS) or 2^-8 (DECODE_FP16) over the first `K - K % 64` columns (the caller adds
    the tail), where xs holds each activation row in the even/odd layout of
    `numba_kernels._scale_row_nb`.
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


dot_4x4 = make_dot(4, 4)
dot_4x2 = make_dot(4, 2)
dot_4x1 = make_dot(4, 1)
dot_1x1 = make_dot(1, 1)
