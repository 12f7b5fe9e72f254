"""Triton `indexer_write_decode`: one new token per sequence folded into the pooled keys or the
tail, one launch (the reference spends about fifteen gathers, scatters and elementwise kernels);
and `indexer_write_verify`: a speculative verify's rows, each sequence's in order in one program,
keeping the tail after each row but the last in a scratch row.

A program owns one token. At pool offset `p % kpool < kpool - 1` it stores the token's (key,
gate) row into its sequence's tail; at the pool's last offset it compresses the tail rows and the
token (per-channel softmax over the pool of gate + ape, in fp32; probabilities, products and the
sum rounded as the reference rounds them) and stores the pooled key where the pool's first
token's slot says, in the cache's format (key_format.py: the model dtype, or FP8 codes and a
scale).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import quantize_rows
from glmflash.kernels.indexer import key_format
from glmflash.kernels.triton_utils import jit
from glmflash.kernels.verify_rows import keeps_copy, sequence_rows


@jit
def indexer_write_decode_kernel(keys, gates, ape, pool_keys, tail, page_table, slots, positions,
                                D, stride_k, stride_g, stride_pk, stride_ts, stride_pt,
                                stride_slots, stride_pos, KPOOL: tl.constexpr, KP: tl.constexpr,
                                PAGE: tl.constexpr, BD: tl.constexpr, FP8_KEYS: tl.constexpr):
    """Token i: `tail[slots[i], offset] = (key, gate)`, or the pooled key of its pool when the
    token completes it (offset = kpool - 1). Tail rows are `[kpool - 1, 2D]`, contiguous."""
    i = tl.program_id(0)
    row = tl.load(slots + i * stride_slots).to(tl.int64)
    pos = tl.load(positions + i * stride_pos).to(tl.int64)
    write_token(keys, gates, ape, pool_keys, tail, page_table, row, pos, i.to(tl.int64), D,
                stride_k, stride_g, stride_pk, stride_ts, stride_pt, KPOOL, KP, PAGE, BD, FP8_KEYS)


@jit
def write_token(keys, gates, ape, pool_keys, tail, page_table, row, pos, t, D, stride_k,
                stride_g, stride_pk, stride_ts, stride_pt, KPOOL: tl.constexpr,
                KP: tl.constexpr, PAGE: tl.constexpr, BD: tl.constexpr, FP8_KEYS: tl.constexpr):
    """Row `t` of keys / gates, at position `pos` of the sequence in page-table row / state
    slot `row`, into that slot's tail or, when it completes its pool, the pooled key."""
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    dt = tail.dtype.element_ty
    b_key = tl.load(keys + t * stride_k + o_d, mask=m_d, other=0.0).to(dt)
    b_gate = tl.load(gates + t * stride_g + o_d, mask=m_d, other=0.0).to(dt)
    offset = pos % KPOOL
    p_tail = tail + row * stride_ts
    if offset < KPOOL - 1:
        tl.store(p_tail + offset * (2 * D) + o_d, b_key, mask=m_d)
        tl.store(p_tail + offset * (2 * D) + D + o_d, b_gate, mask=m_d)
    else:
        # The pool's rows [KP, BD]: the kpool - 1 tail rows, then the new token; rows past
        # the pool padded (-inf gates, zero keys).
        o_j = tl.arange(0, KP)
        in_tail = o_j < KPOOL - 1
        m_jd = in_tail[:, None] & m_d[None, :]
        p_rows = p_tail + o_j[:, None] * (2 * D) + o_d[None, :]
        is_new = (o_j == KPOOL - 1)[:, None]
        b_k = tl.where(is_new, b_key[None, :], tl.load(p_rows, mask=m_jd, other=0.0))
        b_g = tl.where(is_new, b_gate[None, :], tl.load(p_rows + D, mask=m_jd, other=0.0))
        m_pool = (o_j < KPOOL)[:, None] & m_d[None, :]
        b_ape = tl.load(ape + o_j[:, None] * D + o_d[None, :], mask=m_pool, other=0.0)
        # Padding rows get -inf; padding channels stay finite (their result is not stored).
        b_logit = tl.where((o_j < KPOOL)[:, None], b_g.to(tl.float32) + b_ape.to(tl.float32),
                           float("-inf"))
        b_e = tl.exp(b_logit - tl.max(b_logit, 0)[None, :])
        b_p = (b_e / tl.sum(b_e, 0)[None, :]).to(dt)
        b_prod = (b_p.to(tl.float32) * b_k.to(tl.float32)).to(dt)
        b_pooled = tl.sum(b_prod.to(tl.float32), 0).to(dt)
        start = pos - offset
        page = tl.load(page_table + row * stride_pt + start // PAGE).to(tl.int64)
        target = (page * PAGE + start % PAGE) // KPOOL
        p_key = pool_keys + target * stride_pk
        if FP8_KEYS:
            # e4m3 codes, then the fp32 scale in the four bytes after them (key_format.py).
            b_code, b_scale = quantize_rows(b_pooled.to(tl.float32)[None, :], tl.float8e4nv)
            tl.store(p_key + o_d[None, :], b_code.to(tl.uint8, bitcast=True),
                     mask=m_d[None, :])
            tl.store((p_key + D).to(tl.pointer_type(tl.float32)) + tl.zeros([1], tl.int32),
                     b_scale)
        else:
            tl.store(p_key + o_d, b_pooled.to(pool_keys.dtype.element_ty), mask=m_d)


@jit
def indexer_write_verify_kernel(keys, gates, ape, pool_keys, tail, saved, page_table, slots,
                                positions, seqs, num_steps, D, stride_k, stride_g, stride_pk,
                                stride_ts, stride_pt, KPOOL: tl.constexpr, KP: tl.constexpr,
                                PAGE: tl.constexpr, BD: tl.constexpr, BTAIL: tl.constexpr,
                                SAVE: tl.constexpr, FP8_KEYS: tl.constexpr):
    """One sequence of a speculative verify: its rows in order (`seqs[b]`: first row, rows,
    scratch row or -1), each written as `indexer_write_decode_kernel` writes a token; after
    each row but the last, the slot's tail is copied to scratch row `scratch_row * num_steps
    + j` of `saved`."""
    i_b = tl.program_id(0)
    first, num_rows, scratch_row = sequence_rows(seqs, i_b)
    o_t = tl.arange(0, BTAIL)
    m_t = o_t < (KPOOL - 1) * 2 * D
    for j in range(0, num_rows):
        t = (first + j).to(tl.int64)
        row = tl.load(slots + t).to(tl.int64)
        pos = tl.load(positions + t).to(tl.int64)
        write_token(keys, gates, ape, pool_keys, tail, page_table, row, pos, t, D, stride_k,
                    stride_g, stride_pk, stride_ts, stride_pt, KPOOL, KP, PAGE, BD, FP8_KEYS)
        tl.debug_barrier()  # the tail row is written before any thread reads the tail again
        if SAVE:
            keep = keeps_copy(scratch_row, j, num_rows)
            m_keep = m_t & ((o_t * 0 + keep) != 0)
            b_tail = tl.load(tail + row * stride_ts + o_t, mask=m_keep, other=0.0)
            tl.store(saved + (scratch_row * num_steps + j) * ((KPOOL - 1) * 2 * D) + o_t,
                     b_tail, mask=m_keep)


def indexer_write_decode(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, *, page_size: int,
                         num_warps: int | None = None) -> None:
    """Triton `ref.indexer_write_decode`: token i of keys / gates `[T, D]` at `positions[i]`
    of the sequence in page-table row / state slot `rows[i]`. One launch, nothing read on the
    host. `num_warps`: default 4 for keys wider than 256, else 1 (a program holds a [kpool, D]
    tile)."""
    kpool, dim = _check_write(keys, gates, ape, pool_keys, tail, page_table, page_size)
    num = rows.numel()
    assert positions.numel() == num and keys.shape[0] >= num
    if num == 0:
        return
    indexer_write_decode_kernel[(num,)](
        keys, gates, ape, pool_keys, tail, page_table, rows, positions, dim, keys.stride(0),
        gates.stride(0), pool_keys.stride(0), tail.stride(0), page_table.stride(0),
        rows.stride(0), positions.stride(0), KPOOL=kpool, KP=triton.next_power_of_2(kpool),
        PAGE=page_size, BD=max(16, triton.next_power_of_2(dim)),
        FP8_KEYS=key_format.is_fp8(pool_keys), num_warps=num_warps or (4 if dim > 256 else 1))


def indexer_write_verify(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         slots: torch.Tensor, positions: torch.Tensor, seqs: torch.Tensor,
                         saved: torch.Tensor | None, num_steps: int, *, page_size: int,
                         num_warps: int | None = None) -> None:
    """A speculative verify's rows (row r: keys / gates row r, state slot `slots[r]`, position
    `positions[r]`), each sequence's in order in one program (`seqs` `[B, 3]` int32: first
    row, rows, scratch row or -1); the tail after each row but a sequence's last goes to
    `saved` `[R * num_steps, kpool - 1, 2D]` (None: nothing kept). One launch."""
    kpool, dim = _check_write(keys, gates, ape, pool_keys, tail, page_table, page_size)
    assert slots.is_contiguous() and positions.is_contiguous()
    assert seqs.dtype == torch.int32 and seqs.is_contiguous() and seqs.shape[1:] == (3,)
    if saved is not None:
        assert saved.shape[1:] == tail.shape[1:] and saved.is_contiguous()
    if seqs.shape[0] == 0:
        return
    indexer_write_verify_kernel[(seqs.shape[0],)](
        keys, gates, ape, pool_keys, tail, tail if saved is None else saved, page_table, slots,
        positions, seqs, num_steps, dim, keys.stride(0), gates.stride(0), pool_keys.stride(0),
        tail.stride(0), page_table.stride(0), KPOOL=kpool, KP=triton.next_power_of_2(kpool),
        PAGE=page_size, BD=max(16, triton.next_power_of_2(dim)),
        BTAIL=max(1, triton.next_power_of_2((kpool - 1) * 2 * dim)), SAVE=saved is not None,
        FP8_KEYS=key_format.is_fp8(pool_keys), num_warps=num_warps or (4 if dim > 256 else 1))


def _check_write(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                 pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                 page_size: int) -> tuple[int, int]:
    """The layouts both write launchers take; (kpool, D)."""
    kpool, dim = ape.shape
    assert keys.stride(-1) == 1 and gates.stride(-1) == 1 and ape.is_contiguous()
    assert tail.shape[1:] == (kpool - 1, 2 * dim) and tail[0].is_contiguous()
    assert pool_keys.stride(1) == 1 and page_table.stride(1) == 1
    assert key_format.key_dim(pool_keys) == dim
    assert page_size % kpool == 0, "a pool never straddles pages"
    return kpool, dim
