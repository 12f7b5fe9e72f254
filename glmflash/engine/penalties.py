"""Repetition, presence and frequency penalties from per-sequence token counts kept on the device.

A sequence's counts are built from its tokens when it is first sampled (the prompt once, for the
repetition penalty) and then follow the sampled ids on the device, so a step costs no host work
that grows with the context. Only sequences that use a penalty get a slot.
"""

from __future__ import annotations

import torch

from glmflash.engine.sampling_tensors import PenaltyTensors, to_device
from glmflash.engine.sequence import Sequence

_MIN_SLOTS = 8


class PenaltyState:
    """Per-sequence rows of token counts; a row follows its sequence id until `release`."""

    def __init__(self) -> None:
        self.prompt_seen: torch.Tensor | None = None
        """`[num_slots, V]` bool: the token occurs in the prompt."""
        self.output_counts: torch.Tensor | None = None
        """`[num_slots, V]` int32: occurrences of the token in the output."""
        self.slots: dict[int, int] = {}
        self.num_counted: dict[int, int] = {}
        """Output tokens in a sequence's counts (host); a mismatch means an id was dropped."""
        self.free_slots: list[int] = []

    def prepare(self, seqs: list[Sequence], vocab_size: int, device: torch.device) -> list[int]:
        """The slots of `seqs`, (re)counting a sequence whose counts are new or out of date."""
        if not seqs:
            return []
        if self.output_counts is None:
            self.prompt_seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
            self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        assert self.output_counts.shape[1] == vocab_size and self.output_counts.device == device
        for seq in seqs:
            if self.num_counted.get(seq.seq_id) != seq.num_output_tokens:
                self._recount(seq)
        return [self.slots[seq.seq_id] for seq in seqs]

    def apply(self, logits: torch.Tensor, t: PenaltyTensors) -> torch.Tensor:
        """`logits` `[B, V]` with the penalties of rows `t.rows` (see `apply_penalties`)."""
        rows = logits.index_select(0, t.rows)
        counts = self.output_counts.index_select(0, t.slots).float()
        seen = self.prompt_seen.index_select(0, t.slots) | (counts > 0)
        repetition = t.repetition[:, None]
        rows = torch.where(seen, torch.where(rows > 0, rows / repetition, rows * repetition), rows)
        rows = rows - t.frequency[:, None] * counts - t.presence[:, None] * (counts > 0)
        return logits.index_copy(0, t.rows, rows)

    def count(self, token_ids: torch.Tensor, t: PenaltyTensors) -> None:
        """Add this step's sampled ids (`[B]`, on the device) to their sequences' counts."""
        vocab_size = self.output_counts.shape[1]
        flat = t.slots * vocab_size + token_ids.index_select(0, t.rows)
        self.output_counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        for seq_id in t.seq_ids:
            self.num_counted[seq_id] += 1

    def release(self, seq_id: int) -> None:
        slot = self.slots.pop(seq_id, None)
        if slot is not None:
            self.free_slots.append(slot)
            del self.num_counted[seq_id]

    def _recount(self, seq: Sequence) -> None:
        if seq.seq_id not in self.slots:
            if not self.free_slots:
                self._grow()
            self.slots[seq.seq_id] = self.free_slots.pop()
        slot = self.slots[seq.seq_id]
        (token_ids,) = to_device([seq.token_ids], torch.int64, self.output_counts.device)
        self.prompt_seen[slot].zero_().index_fill_(0, token_ids[:seq.num_prompt_tokens], True)
        outputs = token_ids[seq.num_prompt_tokens:]
        self.output_counts[slot].zero_().index_add_(
            0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        self.num_counted[seq.seq_id] = seq.num_output_tokens

    def _grow(self) -> None:
        num_slots = self.output_counts.shape[0]
        new_num_slots = max(_MIN_SLOTS, 2 * num_slots)
        self.prompt_seen = _grown(self.prompt_seen, new_num_slots)
        self.output_counts = _grown(self.output_counts, new_num_slots)
        self.free_slots.extend(range(new_num_slots - 1, num_slots - 1, -1))


def _grown(table: torch.Tensor, num_rows: int) -> torch.Tensor:
    out = table.new_zeros(num_rows, table.shape[1])
    out[: table.shape[0]] = table
    return out


def apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """The spec, one row `[V]` from the sequence's tokens: repetition (prompt + output tokens:
    positive logits divided, negative multiplied), then frequency and presence (output tokens)."""
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=row.device)
        vals = row[seen]
        row = row.clone()
        row[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=row.device),
                                minlength=row.shape[0])
        counts = counts[: row.shape[0]].float()
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return row
