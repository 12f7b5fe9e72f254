"""Triton KDA over a speculative verify: all of a sequence's rows (its last accepted token, then
its drafts) in one launch per layer for the recurrent state and one for the conv window.

A verify's rows are decode rows (`rows` `[T, 3]` int32: token row, state slot, fresh, as
`kda_decode` reads them) grouped into sequences (`seqs` `[B, 3]` int32: first row, number of
rows, scratch row or -1). One program walks its sequence's rows in order and applies to each
exactly the step `kda_decode` / `causal_conv1d_decode` would (the same jit helpers), so every
state it leaves is a decode step's bit for bit. After each row but the sequence's last, the state
is also written to scratch row `scratch_row * num_steps + j` (the commit puts back the accepted
one). The recurrent tile stays in registers from row to row: the slot is read once and written
once, where one launch per position read and wrote it at every position and a copy kernel saved
it. A row may name another slot than the row before it (padding rows of a CUDA graph take the
reserved slot, fresh, after a sequence's own drafts): the walk then writes the tile back to the
slot it leaves and starts from the new one.
"""

from __future__ import annotations

import torch

from glmflash.kernels.kda.triton_impl import (
    DEFAULT_CONFIG,
    GateParams,
    KdaConfig,
    _check_heads,
    conv_block,
    conv_state_update,
    decode_shape,
    gate_operands,
    kda_token_step,
    splat,
)
from glmflash.kernels.triton_utils import jit
from glmflash.kernels.verify_rows import keeps_copy, sequence_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None


@jit
def kda_verify_kernel(q, k, v, g, beta, state, saved, o, rows, seqs, dt_bias, a_log,
                      lower_bound, scale, num_steps, stride_q, stride_k, stride_v, stride_g,
                      stride_b, stride_o, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, SAVE: tl.constexpr,
                      GATES: tl.constexpr, HAS_LB: tl.constexpr):
    """One (sequence, head, value block): the rows of the sequence one after another."""
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    first, num_rows, scratch_row = sequence_rows(seqs, i_b)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
    tile = (i_h * K + o_k[:, None]) * V + o_v[None, :]  # offsets inside one slot
    slot_size = H * K * V
    b_s = tl.zeros([BK, BV], dtype=tl.float32)
    held = tl.load(rows + first * 3 + 1).to(tl.int64)  # the slot the tile belongs to
    for j in range(0, num_rows):
        row = first + j
        tok = tl.load(rows + row * 3).to(tl.int64)
        slot = tl.load(rows + row * 3 + 1).to(tl.int64)
        fresh = tl.load(rows + row * 3 + 2)
        switch = ((j == 0) | (slot != held) | (fresh != 0)).to(tl.int32)
        on_switch = splat(o_k, switch)[:, None] != 0
        # Leaving a slot: its state so far goes back; then the new slot's (zeros if fresh).
        tl.store(state + held * slot_size + tile, b_s,
                 mask=m_s & on_switch & (splat(o_k, j)[:, None] > 0))
        b_new = tl.load(state + slot * slot_size + tile,
                        mask=m_s & on_switch & (splat(o_k, fresh)[:, None] == 0), other=0.0)
        b_s = tl.where(on_switch, b_new, b_s)
        b_s = kda_token_step(q, k, v, g, beta, o, b_s, tok, i_h, o_k, o_v, dt_bias, a_log,
                             lower_bound, scale, stride_q, stride_k, stride_v, stride_g,
                             stride_b, stride_o, K, V, GATES, HAS_LB)
        if SAVE:
            keep = keeps_copy(scratch_row, j, num_rows)
            tl.store(saved + (scratch_row * num_steps + j) * slot_size + tile, b_s,
                     mask=m_s & (splat(o_k, keep)[:, None] != 0))
        held = slot
    tl.store(state + held * slot_size + tile, b_s, mask=m_s & (splat(o_k, num_rows)[:, None] > 0))


@jit
def conv_verify_kernel(x, weight, conv_state, saved, out, rows, seqs, num_steps, stride_x,
                       stride_o, C, HIST: tl.constexpr, HP: tl.constexpr, BC: tl.constexpr,
                       SAVE: tl.constexpr):
    """One (sequence, channel block): the rows of the sequence one after another, each a decode
    step of the short conv (its output, then the slot's new history)."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    first, num_rows, scratch_row = sequence_rows(seqs, i_b)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    o_j = tl.arange(0, HP)
    for j in range(0, num_rows):
        row = first + j
        tok = tl.load(rows + row * 3)
        slot = tl.load(rows + row * 3 + 1).to(tl.int64)
        fresh = tl.load(rows + row * 3 + 2)
        conv_block(x, weight, conv_state, out, stride_x, stride_o, C, tok, tok, tok + 1, slot,
                   fresh, o_c, HIST, 1, BC)
        tl.debug_barrier()  # every thread has read the history before any thread replaces it
        b_hist = conv_state_update(x, conv_state, stride_x, C, tok, tok + 1, slot, fresh, o_c,
                                   m_c, HIST, HP)
        if SAVE:
            keep = keeps_copy(scratch_row, j, num_rows)
            p_saved = saved + ((scratch_row * num_steps + j) * C + o_c)[:, None] * HIST
            tl.store(p_saved + o_j[None, :], b_hist,
                     mask=m_c[:, None] & (o_j < HIST)[None, :] & (splat(o_j, keep)[None, :] != 0))
        tl.debug_barrier()  # the new history is written before the next row reads it


def _check_metas(rows: torch.Tensor, seqs: torch.Tensor) -> None:
    for meta, name in ((rows, "rows"), (seqs, "seqs")):
        assert meta.dtype == torch.int32 and meta.is_contiguous() and meta.shape[1:] == (3,), (
            f"{name} must be int32 [N, 3], got {meta.dtype}{tuple(meta.shape)}")


def _check_saved(saved: torch.Tensor | None, live: torch.Tensor) -> torch.Tensor:
    """The tensor the kernels write scratch rows into (`live` itself when nothing is kept: the
    SAVE=False kernels never touch it)."""
    if saved is None:
        return live
    assert saved.dtype == live.dtype and saved.shape[1:] == live.shape[1:] and \
        saved.is_contiguous(), f"scratch rows {tuple(saved.shape)} vs state {tuple(live.shape)}"
    return saved


def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, seqs: torch.Tensor,
               saved: torch.Tensor | None, num_steps: int, out: torch.Tensor | None = None, *,
               gates: GateParams | None = None,
               config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """The gated delta rule over a verify's rows (module docstring). `saved` `[R * num_steps,
    H, dk, dv]` takes the state after each row but a sequence's last (None: nothing kept).
    Only the rows' outputs are written (`out` `[T, H, dv]` when given). With `gates`, g and
    beta are the gates' pre-activations (as `kda_decode`)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_heads(t, name)
    assert state.dtype == torch.float32 and state.is_contiguous()
    _check_metas(rows, seqs)
    target = _check_saved(saved, state)
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    if out is None:
        out = torch.empty(q.shape[0], heads, dv, dtype=q.dtype, device=q.device)
    assert out.shape == (q.shape[0], heads, dv) and out.stride(2) == 1 and out.stride(1) == dv
    num_seqs = seqs.shape[0]
    if num_seqs:
        bv, warps = decode_shape(config, num_seqs, dv)
        ops = gate_operands(g, beta, gates)
        kda_verify_kernel[(num_seqs, heads, triton.cdiv(dv, bv))](
            q, k, v, g, beta, state, target, out, rows, seqs, ops.dt_bias, ops.a_log,
            ops.bound, dk ** -0.5, num_steps, q.stride(0), k.stride(0), v.stride(0),
            ops.stride_g, ops.stride_b, out.stride(0), H=heads, K=dk, V=dv,
            BK=triton.next_power_of_2(dk), BV=bv, SAVE=saved is not None, GATES=ops.fused,
            HAS_LB=ops.has_lb, num_warps=warps)
    return out


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         rows: torch.Tensor, seqs: torch.Tensor, saved: torch.Tensor | None,
                         num_steps: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The short conv over a verify's rows (module docstring); `saved` `[R * num_steps, C,
    K - 1]` as `kda_verify`'s."""
    channels = x.shape[1]
    hist = weight.shape[1] - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    _check_metas(rows, seqs)
    target = _check_saved(saved, conv_state)
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.stride(1) == 1
    if seqs.shape[0]:
        conv_verify_kernel[(seqs.shape[0], triton.cdiv(channels, 256))](
            x, weight, conv_state, target, out, rows, seqs, num_steps, x.stride(0),
            out.stride(0), channels, HIST=hist, HP=triton.next_power_of_2(hist), BC=256,
            SAVE=saved is not None, num_warps=4)
    return out


__all__ = ["causal_conv1d_verify", "kda_verify"]
