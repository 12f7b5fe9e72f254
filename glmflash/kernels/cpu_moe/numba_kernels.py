"""The Numba kernels of the CPU experts: grouping pairs by expert, gate/up with clamped SwiGLU,
down with the weighted sum, and the NUMA placement copy (derivation in README.md).

Workers claim TASK_ROWS-row chunks from an atomic counter, so a stalled or busy core does not
hold up the others, and each chunk is one contiguous run of bytes per matrix. With K thread pools
(`pools.py`) each pool owns a slice of every expert's rows and has its own counter. The block
scale and the decode's power of two are folded into a per-(expert, row-block) copy of the
activations, so the inner loop (llvm_ir.py) is one FMA per weight and a row sum is rescaled once.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from glmflash.kernels.cpu_moe.llvm_ir import (
    DECODE_FP16,
    E4M3_MASK,
    F16_MASK,
    STEP,
    bits_as_f32,
    dot_1x1,
    dot_4x1,
    dot_4x2,
    dot_4x4,
    f16_bits_as_f32,
    fetch_add,
    set_affinity,
)

BLOCK = 128
# tokens of one expert per pass over a row group; weight rows per pass
TOKEN_GROUP = 8
ROW_GROUP = 4
# rows of one work item taken by a worker from the shared task counter
TASK_ROWS = 128
# distance of the software prefetch ahead of each row's read position
PREFETCH_BYTES = 16384
# Activations are pre-scaled so a product never underflows: 2^-120 * 2^64 leaves row sums at
# 2^-56, undone once per sum; fp16 decodes need only 2^8. Indexed by the decode.
_X_SCALE = (np.float32(2.0**64), np.float32(2.0**8))
_OUT_SCALE = (np.float32(2.0**56), np.float32(1.0))
# NOTE: per-worker accumulator rows are 128 bytes wide (TOKEN_GROUP floats used) so two workers
# never write one cache line.
ACC_WIDTH = 32
# NOTE: pool p's task counter is task_counter[p * COUNTER_STRIDE]: 16 int64 = 128 bytes, so
# no two counters (and no adjacent-line prefetch pair) share a cache line.
COUNTER_STRIDE = 16
_FAST = {"reassoc", "contract"}


@njit(cache=True, nogil=True, inline="always")
def _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks):
    """(counter slot, first row, end row, TASK_ROWS-row chunks) of worker wid's pool; pins the
    thread to the pool's CPUs when masks are given.

    NOTE: the pin is redone on every call, in the thread that runs worker wid, so it holds
    whichever thread (or threading layer) runs it; the caller restores the calling thread's mask.
    """
    pool = wid * (pool_rows.size - 1) // num_workers
    if cpu_masks.shape[0] > 0:
        set_affinity(cpu_masks[pool])
    first, end = pool_rows[pool], pool_rows[pool + 1]
    return pool * COUNTER_STRIDE, first, end, (end - first + TASK_ROWS - 1) // TASK_ROWS


@njit(cache=True, nogil=True, inline="always")
def _chunk_rows_nb(task, chunks, first, end):
    """(matrix, first row, end row) of task number `task` over matrices of `chunks` chunks."""
    i = task // chunks
    row0 = first + (task - i * chunks) * TASK_ROWS
    return i, row0, min(row0 + TASK_ROWS, end)


@njit(cache=True, nogil=True, inline="always")
def _reset_counters_nb(pool_rows, task_counter):
    for p in range(pool_rows.size - 1):
        task_counter[p * COUNTER_STRIDE] = 0


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _e4m3_nb(q, decode):
    """e4m3 byte -> its value scaled as the vector decode `decode` scales it."""
    q = np.int32(q)
    if decode == DECODE_FP16:
        return f16_bits_as_f32((q << 7) & F16_MASK)
    return bits_as_f32((q << 20) & E4M3_MASK)


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
                sums = dot_4x4(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(16):
                    acc[i // 4, t + i % 4] = sums[i]
                t += 4
            elif num_tokens - t >= 2:
                sums2 = dot_4x2(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(8):
                    acc[i // 2, t + i % 2] = sums2[i]
                t += 2
            else:
                sums1 = dot_4x1(w, n, xs[t:], PREFETCH_BYTES, decode)
                for i in range(4):
                    acc[i, t] = sums1[i]
                t += 1
    else:
        for r in range(num_rows):
            for t in range(num_tokens):
                acc[r, t] = dot_1x1(w, n + r, xs[t:], PREFETCH_BYTES, decode)[0]
    k_len = w.shape[1]
    for r in range(num_rows):
        for t in range(num_tokens):
            tail = np.float32(0.0)
            for k in range(k_len - k_len % STEP, k_len):
                tail += _e4m3_nb(w[n + r, k], decode) * xs[t, k]
            acc[r, t] += tail


@njit(cache=True, nogil=True, fastmath=_FAST, inline="always")
def _scale_row_nb(x, scales, block, out, x_scale):
    """out = x[k] * scales[k // block] * x_scale in the layout the fp8 dot reads; x [K].

    Below K - K % 64, each 32-wide chunk holds its even elements, then its odd ones (the order in
    which `_ir_decode_pair_*` yield weights); the tail keeps the natural order. block % 32 == 0.
    """
    size = x.size
    k_end = size - size % STEP
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
        task = fetch_add(task_counter, slot, 1)
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
            task = fetch_add(task_counter, slot, 1)


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
        task = fetch_add(task_counter, slot, 1)
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
            task = fetch_add(task_counter, slot, 1)


@njit(cache=True, nogil=True, parallel=True)
def _place_rows_nb(src, pool_rows, cpu_masks, task_counter, num_workers, dst):
    """dst = src [E, N, K] int8, each pool's rows copied by that pool's workers (pinned first),
    so the first touch of every page comes from the node that will read it.
    """
    num_experts = src.shape[0]
    _reset_counters_nb(pool_rows, task_counter)
    for wid in prange(num_workers):
        slot, first, end, chunks = _enter_pool_nb(wid, num_workers, pool_rows, cpu_masks)
        task = fetch_add(task_counter, slot, 1)
        while task < num_experts * chunks:
            e, row0, row1 = _chunk_rows_nb(task, chunks, first, end)
            dst[e, row0:row1] = src[e, row0:row1]
            task = fetch_add(task_counter, slot, 1)
