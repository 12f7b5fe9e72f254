"""Triton `indexer_write_decode`: one new token per sequence folded into the pooled keys or the
tail, one launch (the reference spends about fifteen gathers, scatters and elementwise kernels).

A program owns one token. At pool offset `p % kpool < kpool - 1` it stores the token's (key,
gate) row into its sequence's tail; at the pool's last offset it compresses the tail rows and the
token (per-channel softmax over the pool of gate + ape, in fp32; probabilities, products and the
sum rounded as the reference rounds them) and stores the pooled key where the pool's first
token's slot says. The tokens can be any rows of `keys` / `gates` (`token_rows`), so a verify
step reads its position's rows of the whole forward without a gather.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit


@jit
def indexer_write_decode_kernel(keys, gates, ape, pool_keys, tail, page_table, slots, positions,
                                token_rows, D, stride_k, stride_g, stride_pk, stride_ts,
                                stride_pt, stride_slots, stride_pos, stride_rows,
                                KPOOL: tl.constexpr, KP: tl.constexpr,
                                PAGE: tl.constexpr, BD: tl.constexpr,
                                HAS_TOKEN_ROWS: tl.constexpr):
    """Token i: `tail[slots[i], offset] = (key, gate)`, or the pooled key of its pool when the
    token completes it (offset = kpool - 1). Tail rows are `[kpool - 1, 2D]`, contiguous."""
    i = tl.program_id(0)
    row = tl.load(slots + i * stride_slots).to(tl.int64)
    pos = tl.load(positions + i * stride_pos).to(tl.int64)
    if HAS_TOKEN_ROWS:
        t = tl.load(token_rows + i * stride_rows).to(tl.int64)
    else:
        t = i.to(tl.int64)
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
        tl.store(pool_keys + target * stride_pk + o_d,
                 b_pooled.to(pool_keys.dtype.element_ty), mask=m_d)


def indexer_write_decode(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         rows: torch.Tensor, positions: torch.Tensor, *, page_size: int,
                         token_rows: torch.Tensor | None = None,
                         num_warps: int | None = None) -> None:
    """Triton `ref.indexer_write_decode`: token `token_rows[i]` (default i) of keys / gates
    `[T, D]` at `positions[i]` of the sequence in page-table row / state slot `rows[i]`. One
    launch, nothing read on the host. `num_warps`: default 4 for keys wider than 256, else 1
    (a program holds a [kpool, D] tile)."""
    kpool, dim = ape.shape
    num = rows.numel()
    assert positions.numel() == num and (token_rows is None or token_rows.numel() == num)
    assert keys.stride(-1) == 1 and gates.stride(-1) == 1 and ape.is_contiguous()
    assert tail.shape[1:] == (kpool - 1, 2 * dim) and tail[0].is_contiguous()
    assert pool_keys.stride(1) == 1 and page_table.stride(1) == 1
    assert page_size % kpool == 0, "a pool never straddles pages"
    if num == 0:
        return
    picks = rows if token_rows is None else token_rows
    indexer_write_decode_kernel[(num,)](
        keys, gates, ape, pool_keys, tail, page_table, rows, positions, picks, dim,
        keys.stride(0), gates.stride(0), pool_keys.stride(0), tail.stride(0),
        page_table.stride(0), rows.stride(0), positions.stride(0), picks.stride(0), KPOOL=kpool,
        KP=triton.next_power_of_2(kpool), PAGE=page_size,
        BD=max(16, triton.next_power_of_2(dim)), HAS_TOKEN_ROWS=token_rows is not None,
        num_warps=num_warps or (4 if dim > 256 else 1))
