"""The rows of a speculative step: which sequences verify, which keep the MTP layer's cache, the
parts of a batch, and the rows each sampled sequence's tokens are drawn from."""

from __future__ import annotations

from typing import NamedTuple

import torch

from glmflash.engine.sampling_tensors import uses_penalties
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_runner import MainOutput, gather_rows
from glmflash.utils.device import upload


def is_verify(seq: Sequence, num_tokens: int, needs_sample: bool, drafts: list[int]) -> bool:
    """A decode (the last token an output token), with or without drafts."""
    return needs_sample and num_tokens == 1 + len(drafts) and \
        seq.num_computed_tokens >= seq.num_prompt_tokens


def never_drafts(seq: Sequence) -> bool:
    """Penalties and logits processors depend on the tokens before each draft: a request with
    them never drafts."""
    return bool(seq.params.logits_processors) or uses_penalties(seq.params)


def keeps_mtp_cache(seq: Sequence, start: int, has_prefix_cache: bool) -> bool:
    """Whether the MTP layer runs over what `seq` commits from position `start`: always for a
    sequence that may draft (now or once drafting resumes); for one that never drafts only over
    its prompt, and only while the prefix cache may hand those pages to a sequence that does."""
    return not never_drafts(seq) or (has_prefix_cache and start < seq.num_prompt_tokens)


def batch_part(batch: ScheduledBatch, idx: list[int]) -> ScheduledBatch:
    return ScheduledBatch([batch.seqs[i] for i in idx], [batch.num_tokens[i] for i in idx],
                          [batch.needs_sample[i] for i in idx])


def gather_pieces(pieces: list[tuple[MainOutput, int, int]]) -> torch.Tensor:
    """Rows (first, count) of each piece's hidden states, back to back."""
    parts, run = [], None
    for out, first, count in pieces:
        if run is not None and run[0] is out:
            run[1].append(first)
            run[2].append(count)
        else:
            run = (out, [first], [count])
            parts.append(run)
    return torch.cat([gather_rows(out.hidden, firsts, counts) for out, firsts, counts in parts])


class SampleRows(NamedTuple):
    """The rows a step samples, sampled sequences in batch order, each with all its rows."""

    logits: torch.Tensor
    seqs: list[Sequence]
    offsets: list[int]
    first_row: list[int]
    drafts_of: list[list[int]]
    sampled_of: dict[int, int]
    """Batch index -> index among the sampled sequences."""
    sampled_of_row: list[int]

    @classmethod
    def of(cls, batch: ScheduledBatch, drafts: list[list[int]], main_idx: list[int],
           verify_idx: list[int], main: MainOutput | None,
           verify: MainOutput | None) -> SampleRows:
        main_row = {i: k for k, i in enumerate(i for i in main_idx if batch.needs_sample[i])}
        verify_pos = {i: k for k, i in enumerate(verify_idx)}
        offset = main.logits.shape[0] if main is not None else 0
        index, seqs, offsets, first_row, drafts_of, of_row = ([] for _ in range(6))
        sampled_of = {}
        for i, seq in enumerate(batch.seqs):
            if not batch.needs_sample[i]:
                continue
            sampled_of[i] = len(first_row)
            first_row.append(len(index))
            if i in verify_pos:
                first = offset + verify.cu_seqlens[verify_pos[i]]
                rows = list(range(first, first + 1 + len(drafts[i])))
                drafts_of.append(drafts[i])
            else:
                rows = [main_row[i]]
                drafts_of.append([])
            index += rows
            seqs += [seq] * len(rows)
            offsets += list(range(len(rows)))
            of_row += [sampled_of[i]] * len(rows)
        logits = torch.cat([o.logits for o in (main, verify) if o is not None])
        if index != list(range(logits.shape[0])):
            logits = logits.index_select(0, upload(index, logits.device))
        return cls(logits, seqs, offsets, first_row, drafts_of, sampled_of, of_row)
