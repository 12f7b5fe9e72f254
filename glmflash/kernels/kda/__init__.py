"""KDA ops: `causal_conv1d` and `kda` (gated delta rule) over packed varlen batches.

CUDA tensors go to the Triton kernels (triton_impl.py), CPU tensors to ref.py.
`GLMFLASH_KERNEL_KDA` / `GLMFLASH_KERNEL_CAUSAL_CONV1D` (or `GLMFLASH_KERNEL_KDA` for both)
`=ref|triton` force one implementation.
"""

from __future__ import annotations

import torch

from glmflash.kernels.dispatch import use_triton
from glmflash.kernels.kda.ref import (
    GateParams,
    causal_conv1d_ref,
    gated_rms_norm_ref,
    kda_gates_ref,
    kda_ref,
)
from glmflash.kernels.verify_rows import reference_rows


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool]
                  ) -> torch.Tensor:
    """Depthwise causal conv + SiLU with per-slot history; see `causal_conv1d_ref`."""
    if use_triton(x, "causal_conv1d", "kda"):
        from glmflash.kernels.kda import triton_impl

        return triton_impl.causal_conv1d(x, weight, conv_state, cu_seqlens, state_slots,
                                         is_fresh)
    return causal_conv1d_ref(x, weight, conv_state, cu_seqlens, state_slots, is_fresh)


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, cu_seqlens: list[int], state_slots: list[int],
        is_fresh: list[bool], *, chunk_size: int = 64) -> torch.Tensor:
    """Gated delta rule with per-channel decay; see `kda_ref`."""
    if use_triton(q, "kda"):
        from glmflash.kernels.kda import triton_impl

        return triton_impl.kda(q, k, v, g, beta, state, cu_seqlens, state_slots, is_fresh,
                               chunk_size=chunk_size)
    return kda_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, is_fresh,
                   chunk_size=chunk_size)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, meta: torch.Tensor,
               out: torch.Tensor | None = None, *,
               gates: GateParams | None = None) -> torch.Tensor:
    """`kda` over one token per sequence, with the rows on the device: `meta` `[B, 3]` int32
    (token row, state slot, fresh). The output has the inputs' rows (`out`, when given) and
    only the meta's token rows are written, so a verify reads and writes its positions' rows
    in place. With `gates` (`GateParams`), g and beta are the gates' pre-activations f and b,
    which the Triton step turns into gates itself (one launch fewer than `kda_gates` first).
    The Triton path reads nothing on the host (CUDA graphs); the reference reads `meta`
    back."""
    if use_triton(q, "kda"):
        from glmflash.kernels.kda import triton_impl

        return triton_impl.kda_decode(q, k, v, g, beta, state, meta, out, gates=gates)
    g, beta = _gates_ref(g, beta, gates)
    rows = meta.tolist()
    tokens = [r[0] for r in rows]
    o = kda_ref(q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], state,
                list(range(len(rows) + 1)), [r[1] for r in rows], [bool(r[2]) for r in rows])
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    out[tokens] = o
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         meta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv1d` over one token per sequence: `meta` `[B, 5]` int32 (token row, start,
    end, state slot, fresh); the output's rows as `kda_decode`'s."""
    if use_triton(x, "causal_conv1d", "kda"):
        from glmflash.kernels.kda import triton_impl

        return triton_impl.causal_conv1d_decode(x, weight, conv_state, meta, out)
    rows = meta.tolist()
    tokens = [r[0] for r in rows]
    y = causal_conv1d_ref(x[tokens], weight, conv_state, list(range(len(rows) + 1)),
                          [r[3] for r in rows], [bool(r[4]) for r in rows])
    if out is None:
        out = torch.empty_like(x)
    out[tokens] = y
    return out


def _gates_ref(g: torch.Tensor, beta: torch.Tensor, gates: GateParams | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gates as given, or formed from their pre-activations (`kda_gates_ref`)."""
    if gates is None:
        return g, beta
    return kda_gates_ref(g, gates.dt_bias, gates.a_log, beta, gates.lower_bound)


def kda_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, rows: torch.Tensor, seqs: torch.Tensor,
               saved: torch.Tensor | None, num_steps: int, out: torch.Tensor | None = None, *,
               gates: GateParams | None = None) -> torch.Tensor:
    """`kda_decode` over a speculative verify's rows, sequence by sequence: `rows` `[T, 3]`
    int32 (token row, state slot, fresh), `seqs` `[B, 3]` int32 (first row, rows, scratch row
    or -1); after each row but a sequence's last, its slot's state is also written to
    `saved[scratch_row * num_steps + j]` (`saved` None: nothing kept). `gates` as in
    `kda_decode`. The Triton path is one launch (verify_triton.py); the reference steps one
    row at a time and reads the metas back."""
    if use_triton(q, "kda"):
        from glmflash.kernels.kda.verify_triton import kda_verify as impl

        return impl(q, k, v, g, beta, state, rows, seqs, saved, num_steps, out, gates=gates)
    g, beta = _gates_ref(g, beta, gates)
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    for r, kept in reference_rows(seqs, num_steps):
        kda_decode(q, k, v, g, beta, state, rows[r: r + 1], out)
        if saved is not None and kept is not None:
            saved[kept] = state[int(rows[r, 1])]
    return out


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         rows: torch.Tensor, seqs: torch.Tensor, saved: torch.Tensor | None,
                         num_steps: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """`causal_conv1d_decode` over a verify's rows, as `kda_verify` steps the state."""
    if use_triton(x, "causal_conv1d", "kda"):
        from glmflash.kernels.kda.verify_triton import causal_conv1d_verify as impl

        return impl(x, weight, conv_state, rows, seqs, saved, num_steps, out)
    if out is None:
        out = torch.empty_like(x)
    for r, kept in reference_rows(seqs, num_steps):
        tok, slot, fresh = rows[r].tolist()
        meta = torch.tensor([[tok, tok, tok + 1, slot, fresh]], dtype=torch.int32)
        causal_conv1d_decode(x, weight, conv_state, meta, out)
        if saved is not None and kept is not None:
            saved[kept] = conv_state[slot]
    return out


def kda_gates(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
              lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forget-gate log-decay and beta from their projections; see `kda_gates_ref`."""
    if use_triton(f, "kda_gates", "kda"):
        from glmflash.kernels.kda.gates_triton import kda_gates as impl
    else:
        impl = kda_gates_ref
    return impl(f, dt_bias, a_log, b, lower_bound)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The output's gated per-head RMSNorm; see `gated_rms_norm_ref`."""
    if use_triton(o, "kda_gates", "kda"):
        from glmflash.kernels.kda.gates_triton import gated_rms_norm as impl
    else:
        impl = gated_rms_norm_ref
    return impl(o, gate, weight, eps)


__all__ = ["GateParams", "causal_conv1d", "causal_conv1d_decode", "causal_conv1d_ref",
           "causal_conv1d_verify", "gated_rms_norm", "gated_rms_norm_ref", "kda", "kda_decode",
           "kda_gates", "kda_gates_ref", "kda_ref", "kda_verify"]
