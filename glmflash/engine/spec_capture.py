"""The three forwards speculative decoding records as CUDA graphs (engine/spec_graphs.py owns
them): the verify forward, the MTP layer's draft forward over the verify's rows, and the greedy
acceptance between them. Each reads its inputs from a device buffer laid out by
`pack_verify`, so a replay serves any batch of its shape once new words are copied in."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from glmflash.model.verify import commit_on_device, verify_batch
from glmflash.utils.device import upload
from glmflash.utils.graph_capture import record

if TYPE_CHECKING:
    from glmflash.engine.spec_runner import SpecRunner


@dataclass
class CapturedVerify:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    """The inputs, as `pack_verify` lays them out (with state copies kept)."""
    staging: torch.Tensor
    """Page-locked host copy of `packed`, rewritten per replay."""
    hidden: torch.Tensor
    """`[B * (k + 1), D]` main hidden state of every row; the draft graph reads it."""
    logits: torch.Tensor
    """`[B * (k + 1), V]` logits of every row."""
    draft: CapturedDraft | None = None
    """The draft graph of the same size and width, which reads `hidden`."""
    accept: CapturedAccept | None = None
    """The greedy acceptance between the two (`replay_greedy`)."""


@dataclass
class CapturedDraft:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    """The inputs, as `pack_verify` lays them out (nothing kept)."""
    staging: torch.Tensor
    out: torch.Tensor
    """`[B * (k + 1), D]` the MTP layer's pre-norm output of every row."""
    ids: torch.Tensor
    """`[B * (k + 1)]` the id each row drafts."""


@dataclass
class CapturedAccept:
    graph: torch.cuda.CUDAGraph
    result: torch.Tensor
    """`[B, k + 2]` int64: each row's argmax (k + 1), then the drafts accepted."""


ARGMAX_DECIDES = -1
"""A sequence's forced acceptance when there is none: the argmax decides."""
DRAFTS_ROW, FORCED_ROW = 0, 1
"""Rows of the acceptance graph's per-step inputs."""


def capture_verify(spec: SpecRunner, packed_host: np.ndarray, size: int, width: int,
                   rows_per_seq: int, pool: tuple[int, int] | None) -> CapturedVerify:
    """The verify forward of `size` sequences of `rows_per_seq` rows (state copies kept)."""
    runner = spec.runner
    packed = upload(packed_host, runner.device)
    num_tokens = [rows_per_seq] * size

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        batch = verify_batch(packed, num_tokens, runner.page_table, runner.page_size, width,
                             spec.scratch)
        hidden = runner.model.hidden_states(batch, runner.state)
        return hidden, runner.model.logits(hidden)

    graph, (hidden, logits) = record(forward, pool, runner.device)
    return CapturedVerify(graph, packed, staging(packed), hidden, logits)


def capture_draft(spec: SpecRunner, packed: torch.Tensor, verify: CapturedVerify,
                  size: int, width: int, rows_per_seq: int,
                  pool: tuple[int, int] | None) -> CapturedDraft:
    """The MTP layer over the verify's rows, reading its hidden states in place; `packed` (on
    the device, as `pack_verify` lays out rows without state copies) holds its inputs."""
    runner = spec.runner
    num_tokens = [rows_per_seq] * size

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        batch = verify_batch(packed, num_tokens, runner.page_table, runner.page_size, width,
                             None)
        embeds = runner.model.text.embed_tokens(batch.input_ids)
        out = spec.mtp.layer.hidden(verify.hidden, embeds, batch, runner.state)
        return out, spec.mtp.logits(runner.model, out).argmax(dim=-1)

    graph, (out, ids) = record(forward, pool, runner.device)
    return CapturedDraft(graph, packed, staging(packed), out, ids)


def capture_accept(spec: SpecRunner, verify: CapturedVerify, draft_inputs: torch.Tensor,
                   width: int, rows_per_seq: int, step_inputs: torch.Tensor,
                   pool: tuple[int, int] | None) -> CapturedAccept:
    """Greedy acceptance over the verify graph's outputs, the commit, and the draft graph's
    inputs (`draft_inputs`, its `packed`) written in place. `step_inputs` `[2, B]`: the drafts
    each sequence has (its rows past them are padding), and the drafts it accepts regardless of
    the argmax (`ARGMAX_DECIDES`: none; benchmarks force a rate)."""
    runner, size = spec.runner, step_inputs.shape[1]
    num_drafts, forced = step_inputs[DRAFTS_ROW], step_inputs[FORCED_ROW]
    num_tokens, page = [rows_per_seq] * size, runner.page_size

    def forward() -> tuple[torch.Tensor]:
        batch = verify_batch(verify.packed, num_tokens, runner.page_table, page, width,
                             spec.scratch)
        draft = verify_batch(draft_inputs, num_tokens, runner.page_table, page, width, None)
        targets = verify.logits.argmax(dim=-1).view(size, rows_per_seq)
        drafts = batch.input_ids.view(size, rows_per_seq)[:, 1:]
        # Leading drafts equal to the argmax: positions before the first mismatch.
        mismatches = (targets[:, :-1] != drafts).long().cumsum(dim=1)
        leading = (mismatches == 0).long().sum(dim=1)
        chosen = torch.where(forced != ARGMAX_DECIDES, forced, leading)
        # Never past a sequence's own drafts (its later rows are padding).
        accepted = torch.minimum(chosen, num_drafts)
        slots = batch.decode.state_slots.view(size, rows_per_seq)
        commit_on_device(runner.state, spec.scratch, slots[:, 0], accepted, num_drafts)
        # The MTP layer's rows: each accepted position with the token after it (the argmax
        # there); padding rows (reserved slot and page, positions 0..k) elsewhere.
        j = torch.arange(rows_per_seq, device=targets.device)
        valid = j[None, :] <= accepted[:, None]
        pad_slot = torch.full_like(j, runner.dummy_slot)
        fields = ((draft.token_slots, batch.token_slots, runner.dummy_page * page + j % page),
                  (draft.decode.positions, batch.decode.positions, j),
                  (draft.decode.state_slots, batch.decode.state_slots, pad_slot))
        draft.input_ids.copy_(targets.view(-1))
        for dest, real, pad in fields:
            dest.copy_(torch.where(valid, real.view(size, rows_per_seq), pad).view(-1))
        return (torch.cat([targets, accepted[:, None]], dim=1),)

    graph, (result,) = record(forward, pool, runner.device)
    return CapturedAccept(graph, result)


def staging(packed: torch.Tensor) -> torch.Tensor:
    """A page-locked host copy of `packed`'s shape, for the words of each replay."""
    return torch.empty_like(packed, device="cpu").pin_memory()
