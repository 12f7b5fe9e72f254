"""The verify forward of speculative decoding: each sequence's last token and its drafts in one
forward, with the fixed-size state committed only up to the accepted position.

Everything but the fixed-size state runs as an extend of `1 + drafts` tokens per sequence (MLA
latents, indexer selection, MoE). The three per-sequence states that a token advances - the KDA
recurrent state, the short-conv window and the indexer's pending tail - are advanced one draft
position at a time by the decode kernels themselves (so each position's state is exactly what a
decode step would have made), in place in the sequence's state slot, and after every position
but a sequence's last a copy goes to a scratch row. `commit` then puts back the copy of the
accepted position, or leaves the slot as it is when every draft was accepted: nothing is
recomputed. MLA latents and pooled indexer keys of rejected tokens sit past the sequence's
committed length, where nothing reads them before the next tokens overwrite them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from glmflash.config import MLA, ModelConfig
from glmflash.kernels.indexer import indexer_write_decode
from glmflash.kernels.kda import causal_conv1d_decode, kda_decode
from glmflash.model.state import ModelState
from glmflash.utils.device import upload


@dataclass(slots=True)
class VerifyPosition:
    """The sequences that have a token at draft position j (0: the last accepted token)."""

    token_rows: torch.Tensor
    """`[n]` int64 rows of the forward's tokens at position j."""
    state_slots: torch.Tensor
    """`[n]` int64 state slots (page-table rows) of their sequences."""
    positions: torch.Tensor
    """`[n]` int64 positions of those tokens in their sequences."""
    kda_meta: torch.Tensor
    """`[n, 3]` int32 decode rows of the KDA kernel over the gathered tokens."""
    conv_meta: torch.Tensor
    """`[n, 5]` int32 decode rows of the conv kernel over the gathered tokens."""
    save_slots: torch.Tensor
    """`[m]` int64 slots whose state after position j is kept (sequences with more tokens)."""
    save_rows: torch.Tensor
    """`[m]` int64 their scratch rows (batch rows of the verify)."""


class VerifyScratch:
    """Per state-carrying layer, the state after each draft position but the last:
    `[rows, num_steps, ...]` (rows: sequences verified together, num_steps: drafts)."""

    def __init__(self, config: ModelConfig, state: ModelState, num_rows: int,
                 num_steps: int) -> None:
        self.num_rows, self.num_steps = num_rows, num_steps
        self.recurrent = {i: _scratch(t, num_rows, num_steps) for i, t in state.recurrent.items()}
        self.conv = {i: _scratch(t, num_rows, num_steps) for i, t in state.conv.items()}
        self.index_tail = {i: _scratch(state.index_tail[i], num_rows, num_steps)
                           for i, kind in enumerate(config.layer_types)
                           if kind == MLA and i in state.index_tail}

    def save(self, scratch: torch.Tensor, live: torch.Tensor, at: VerifyPosition,
             step: int) -> None:
        if at.save_rows.numel():
            scratch[at.save_rows, step] = live[at.save_slots]


def scratch_bytes(config: ModelConfig, num_rows: int, num_steps: int, dtype: torch.dtype) -> int:
    """Bytes of a VerifyScratch (the state slots' size, `num_rows * num_steps` times; the
    MTP layer's tail is not in it)."""
    from glmflash.model.state import cache_bytes

    return cache_bytes(config, dtype)[1] * num_rows * num_steps


def _scratch(live: torch.Tensor, num_rows: int, num_steps: int) -> torch.Tensor:
    return torch.zeros(num_rows, num_steps, *live.shape[1:], dtype=live.dtype, device=live.device)


@dataclass(slots=True)
class VerifyInputs:
    """What the layers of a verify forward read (`ForwardBatch.verify`)."""

    steps: list[VerifyPosition]
    scratch: VerifyScratch


def verify_positions(num_tokens: list[int], prefix_lens: list[int], state_slots: list[int],
                     device: torch.device) -> list[VerifyPosition]:
    """Per draft position, the decode rows of the sequences that reach it (host arithmetic,
    one upload). Sequence b has `num_tokens[b]` tokens from position `prefix_lens[b]`."""
    starts = np.cumsum([0, *num_tokens])[:-1]
    slots_of = np.asarray(state_slots, np.int64)
    parts = []
    for j in range(max(num_tokens)):
        seqs = np.asarray([b for b, n in enumerate(num_tokens) if n > j], np.int64)
        saved = np.asarray([b for b, n in enumerate(num_tokens) if n > j + 1], np.int64)
        slots, rows = slots_of[seqs], np.arange(seqs.size, dtype=np.int64)
        zero = np.zeros(seqs.size, np.int64)
        parts.append([starts[seqs] + j, slots, np.asarray(prefix_lens, np.int64)[seqs] + j,
                      np.stack([rows, slots, zero], 1), np.stack([rows, rows, rows + 1, slots,
                                                                  zero], 1),
                      slots_of[saved], saved])
    flat = [p.reshape(-1) for part in parts for p in part]
    pieces = iter(upload(np.concatenate(flat), device).split([p.size for p in flat]))
    out = []
    for _ in parts:
        rows, slots, positions, kda, conv, save_slots, save_rows = (next(pieces)
                                                                    for _ in range(7))
        out.append(VerifyPosition(rows, slots, positions, kda.view(-1, 3).to(torch.int32),
                                  conv.view(-1, 5).to(torch.int32), save_slots, save_rows))
    return out


def commit(state: ModelState, scratch: VerifyScratch, state_slots: list[int],
           num_tokens: list[int], num_accepted: list[int]) -> None:
    """Put each sequence's state after its last accepted token into its slot: the scratch copy
    of position `num_accepted[b]`, unless that was the sequence's last token (already there)."""
    picks = [(slot, b, a) for b, (slot, n, a) in
             enumerate(zip(state_slots, num_tokens, num_accepted, strict=True)) if a < n - 1]
    if not picks:
        return
    device = next(iter(state.latent.values())).device
    slots, rows, steps = upload(np.asarray(picks, np.int64).T.copy(), device)
    for live, saved in ((state.recurrent, scratch.recurrent), (state.conv, scratch.conv),
                        (state.index_tail, scratch.index_tail)):
        for layer, copies in saved.items():
            live[layer][slots] = copies[rows, steps]


def verify_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                verify: VerifyInputs, layer: int) -> torch.Tensor:
    """`causal_conv1d_decode` position by position over x `[T, C]`."""
    out = torch.empty_like(x)
    for j, at in enumerate(verify.steps):
        rows = at.token_rows
        out[rows] = causal_conv1d_decode(x[rows], weight, conv_state, at.conv_meta)
        verify.scratch.save(verify.scratch.conv[layer], conv_state, at, j)
    return out


def verify_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, verify: VerifyInputs,
               layer: int) -> torch.Tensor:
    """`kda_decode` position by position; o `[T, H, dv]`."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    for j, at in enumerate(verify.steps):
        rows = at.token_rows
        out[rows] = kda_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], state,
                               at.kda_meta)
        verify.scratch.save(verify.scratch.recurrent[layer], state, at, j)
    return out


def verify_indexer_write(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         verify: VerifyInputs, layer: int, *, page_size: int) -> None:
    """`indexer_write_decode` position by position (pools completed by a draft are written;
    a rejected one is never read before the real tokens rewrite it)."""
    for j, at in enumerate(verify.steps):
        rows = at.token_rows
        indexer_write_decode(keys[rows], gates[rows], ape, pool_keys, tail, page_table,
                             at.state_slots, at.positions, page_size=page_size)
        verify.scratch.save(verify.scratch.index_tail[layer], tail, at, j)
