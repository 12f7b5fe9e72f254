"""The verify forward of speculative decoding: each sequence's last token and its drafts in one
forward, with the fixed-size state committed only up to the accepted position.

Every row is a decode (model/forward_batch.py `DecodeRows`): its own position, indexer selection
and page-table row, so MLA latents, the selection and the MoE need nothing else; the latents of
all rows are written before any row attends, and a row selects only among the pools complete at
its own position. The three per-sequence states that a token advances - the KDA recurrent
state, the short-conv window and the indexer's pending tail - are advanced one draft position
at a time with the decode kernels' own steps (so each position's state is exactly what a decode
step would have made), in place in the sequence's state slot, and after every position but a
sequence's last a copy goes to a scratch row, by one launch per layer and state over all
positions (kernels/kda/verify_triton.py, kernels/indexer/write_triton.py). `commit` then puts
back the copy of the accepted position, one launch per kind of state over all layers, or leaves
the slot as it is when every draft was accepted: nothing is recomputed. MLA
latents and pooled indexer keys of rejected tokens sit past the sequence's committed length,
where nothing reads them before the next tokens overwrite them. The batch's inputs are views of
one device buffer (`pack_verify`, `verify_batch`), so a CUDA graph replays any verify of its
shape (engine/spec_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from glmflash.config import ModelConfig
from glmflash.kernels.indexer import indexer_write_verify
from glmflash.kernels.kda import GateParams, causal_conv1d_verify, kda_verify
from glmflash.kernels.row_copy import copy_rows
from glmflash.model.forward_batch import DECODE_WIDTH, ForwardBatch, decode_batch, pack_decode
from glmflash.model.state import ModelState, StateBlock
from glmflash.utils.device import upload


class VerifyScratch:
    """Per state-carrying layer of the main model (not the MTP layer's tail), the state after
    each draft position but the last: `[rows, num_steps, ...]` (rows: sequences verified
    together, num_steps: drafts), views into one block per kind as ModelState keeps its own."""

    def __init__(self, config: ModelConfig, state: ModelState, num_rows: int,
                 num_steps: int) -> None:
        self.num_rows, self.num_steps = num_rows, num_steps
        self.blocks: dict[str, StateBlock] = {}
        # Per kind, `[layers, 1]` row offsets of each kept layer in the scratch block and in
        # the live block (whose layers may include the MTP layer's tail).
        self._offsets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind in ModelState.STATE_KINDS:
            live = state.blocks[kind]
            layers = [i for i in live.layers if i < len(config.layer_types)]
            self.blocks[kind] = StateBlock.allocate(layers, (num_rows, num_steps),
                                                    tuple(live.block.shape[2:]),
                                                    live.block.dtype, live.block.device)
            offsets = [[k * num_rows * num_steps, live.layers.index(i) * state.num_state_slots]
                       for k, i in enumerate(layers)]
            offsets = torch.tensor(offsets or [[0, 0]], device=live.block.device)
            self._offsets[kind] = (offsets[:, :1].contiguous(), offsets[:, 1:].contiguous())
        self.recurrent = self.blocks["recurrent"].views
        self.conv = self.blocks["conv"].views
        self.index_tail = self.blocks["index_tail"].views

    def put_back(self, state: ModelState, slots: torch.Tensor, sources: torch.Tensor) -> None:
        """Slot `slots[b]` of every kept layer takes scratch row `sources[b]` (`[rows *
        num_steps]` numbering; -1: left as it is): one copy launch per kind, over all its
        layers at once (device tensors in, nothing read on the host)."""
        for kind, saved in self.blocks.items():
            if not saved.layers:
                continue
            live, (saved_offsets, live_offsets) = state.blocks[kind], self._offsets[kind]
            src = torch.where(sources >= 0, saved_offsets + sources, -1)
            dst = live_offsets + slots
            row = live.block.shape[2:]
            copy_rows(saved.block.view(-1, *row), src.view(-1), live.block.view(-1, *row),
                      dst.view(-1))


def scratch_bytes(config: ModelConfig, num_rows: int, num_steps: int, dtype: torch.dtype) -> int:
    """Bytes of a VerifyScratch (the state slots' size, `num_rows * num_steps` times; the
    MTP layer's tail is not in it)."""
    from glmflash.model.state import cache_bytes

    return cache_bytes(config, dtype)[1] * num_rows * num_steps


def _rows(copies: torch.Tensor) -> torch.Tensor:
    """A scratch tensor `[rows, steps, ...]` as `[rows * steps, ...]`, a view (writes land)."""
    return copies.view(-1, *copies.shape[2:])


@dataclass(slots=True)
class VerifyInputs:
    """What the layers of a verify forward read (`ForwardBatch.verify`)."""

    rows: torch.Tensor
    """`[T, 3]` int32 (token row, state slot, fresh) of every row: the decode rows'."""
    seqs: torch.Tensor
    """`[B, 3]` int32 (first row, rows, scratch row or -1) of every sequence."""
    scratch: VerifyScratch | None
    """Where the state after each position but a sequence's last is kept; None when nothing is
    kept (the MTP layer's draft forward, whose rows past the committed ones are padding)."""

    def kept_rows(self, kind: str, layer: int) -> tuple[torch.Tensor | None, int]:
        """(the scratch rows `[rows * steps, ...]` of `layer`'s state of `kind` - recurrent,
        conv or index_tail - and the steps a sequence has there), or (None, 0) without one,
        as the verify kernels take them."""
        if self.scratch is None:
            return None, 0
        return _rows(getattr(self.scratch, kind)[layer]), self.scratch.num_steps


class VerifyHostRows(NamedTuple):
    """A verify batch on the host: the rows of each sequence back to back (its last accepted
    token, then its drafts), one entry per row, and the rows per sequence."""

    input_ids: list[int]
    token_slots: list[int]
    positions: list[int]
    state_slots: list[int]
    fresh: list[int]
    """1 where a row's state starts at zero (the first row of a padding sequence)."""
    num_tokens: list[int]
    """Rows of each sequence."""
    num_pools: int
    """The most complete indexer pools of any row."""


def verify_rows(ids: list[list[int]], token_slots: list[list[int]], starts: list[int],
                state_slots: list[int], num_pools: int) -> VerifyHostRows:
    """The rows of sequences whose token lists `ids[b]` start at position `starts[b]`."""
    positions = [p for start, seq in zip(starts, ids, strict=True)
                 for p in range(start, start + len(seq))]
    slots = [s for slot, seq in zip(state_slots, ids, strict=True) for s in [slot] * len(seq)]
    return VerifyHostRows([t for seq in ids for t in seq],
                          [s for seq in token_slots for s in seq], positions, slots,
                          [0] * len(positions), [len(seq) for seq in ids], num_pools)


def pack_verify(rows: VerifyHostRows, save: bool) -> np.ndarray:
    """The verify batch's device words: the rows as `pack_decode` lays out decodes, then the
    int32 (first row, rows, scratch row or -1 without `save`) of every sequence, as
    `verify_batch` reads them."""
    num = len(rows.input_ids)
    flat = pack_decode(rows.input_ids, rows.token_slots, rows.positions, rows.state_slots,
                       rows.fresh)
    assert flat.size == DECODE_WIDTH * num
    starts = np.cumsum([0, *rows.num_tokens])[:-1]
    count = len(rows.num_tokens)
    scratch_rows = np.arange(count) if save else np.full(count, -1)
    seq_words = np.stack([starts, rows.num_tokens, scratch_rows], 1).reshape(-1).astype(np.int32)
    # Whole int64 words: an odd count of int32 gets one unread zero.
    return np.concatenate([flat, np.pad(seq_words, (0, seq_words.size % 2)).view(np.int64)])


def verify_batch(packed: torch.Tensor, num_tokens: list[int], page_table: torch.Tensor,
                 page_size: int, max_pools: int, scratch: VerifyScratch | None) -> ForwardBatch:
    """The ForwardBatch of a verify whose inputs are views of `packed` (device, from
    `pack_verify`): every row is a decode (its own position, selection and page-table row), and
    each sequence's fixed-size state advances over its rows in order (`VerifyInputs`). Writing
    new values into `packed` changes the batch in place (a CUDA graph replays it)."""
    num, num_seqs = sum(num_tokens), len(num_tokens)
    batch = decode_batch(packed[: DECODE_WIDTH * num], page_table, page_size, max_pools)
    seqs = packed[DECODE_WIDTH * num:][: (3 * num_seqs + 1) // 2].view(torch.int32)
    batch.verify = VerifyInputs(batch.decode.kda_meta, seqs[: 3 * num_seqs].view(num_seqs, 3),
                                scratch)
    return batch


def commit(state: ModelState, scratch: VerifyScratch, state_slots: list[int],
           num_tokens: list[int], num_accepted: list[int]) -> None:
    """Put each sequence's state after its last accepted token into its slot: the scratch copy
    of position `num_accepted[b]`, unless that was the sequence's last token (already there)."""
    picks = [(slot, b, a) for b, (slot, n, a) in
             enumerate(zip(state_slots, num_tokens, num_accepted, strict=True)) if a < n - 1]
    if not picks:
        return
    device = next(iter(state.latent.values())).device
    slots, rows, steps = np.asarray(picks, np.int64).T
    slots, sources = upload(np.stack([slots, rows * scratch.num_steps + steps]), device)
    scratch.put_back(state, slots, sources)


def commit_on_device(state: ModelState, scratch: VerifyScratch, state_slots: torch.Tensor,
                     num_accepted: torch.Tensor, num_drafts: torch.Tensor) -> None:
    """`commit` with the counts on the device (a captured step): sequence b (scratch row b,
    slot `state_slots[b]`, `num_drafts[b]` drafts) takes its scratch copy of position
    `num_accepted[b]`, unless every draft was accepted (its slot already holds that state)."""
    rows = torch.arange(state_slots.shape[0], device=state_slots.device)
    steps = torch.minimum(num_accepted, num_drafts - 1).clamp(min=0)
    sources = torch.where(num_accepted < num_drafts, rows * scratch.num_steps + steps, -1)
    scratch.put_back(state, state_slots, sources)


def verify_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                verify: VerifyInputs, layer: int) -> torch.Tensor:
    """The conv decode step over every row of x `[T, C]`, each sequence's rows in order, the
    window after each but a sequence's last kept in the scratch."""
    saved, num_steps = verify.kept_rows("conv", layer)
    return causal_conv1d_verify(x, weight, conv_state, verify.rows, verify.seqs, saved,
                                num_steps)


def verify_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, verify: VerifyInputs, layer: int,
               gates: GateParams | None = None) -> torch.Tensor:
    """The KDA decode step over every row (each sequence's rows in order, the state after each
    but a sequence's last kept in the scratch); o `[T, H, dv]`. `gates`: g and beta are the
    gates' pre-activations (`kda_decode`)."""
    saved, num_steps = verify.kept_rows("recurrent", layer)
    return kda_verify(q, k, v, g, beta, state, verify.rows, verify.seqs, saved, num_steps,
                      gates=gates)


def verify_indexer_write(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor,
                         pool_keys: torch.Tensor, tail: torch.Tensor, page_table: torch.Tensor,
                         batch: ForwardBatch, layer: int, *, page_size: int) -> None:
    """The indexer's decode write over every row, each sequence's rows in order (pools
    completed by a draft are written; a rejected one is never read before the real tokens
    rewrite it), the tail after each but a sequence's last kept in the scratch."""
    saved, num_steps = batch.verify.kept_rows("index_tail", layer)
    indexer_write_verify(keys, gates, ape, pool_keys, tail, page_table, batch.decode.state_slots,
                         batch.decode.positions, batch.verify.seqs, saved, num_steps,
                         page_size=page_size)
