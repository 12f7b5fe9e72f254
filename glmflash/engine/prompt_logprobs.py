"""Prompt log-probabilities (SamplingParams.prompt_logprobs), computed during prefill.

The logits at prompt position p give the distribution of token p + 1. A prefill chunk covering
positions [start, start + n) of a sequence that asked therefore adds extra logit rows for the
positions whose next prompt token still lacks its entry; the runner appends these rows after the
sampled ones (ForwardBatch.logits_index), so a batch where nobody asked is unchanged. Chunked
prefill just fills the list chunk by chunk; a recompute after preemption continues or finds it
complete. The engine tells the runner's tracker which sequences are admitted and finished.
The values are the raw model distribution (no temperature, penalties or processors), as vLLM's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.sequence import Sequence


@dataclass(slots=True)
class PromptLogprobRows:
    """The extra logit rows of one forward, in order, and whom they belong to."""

    rows: list[int]
    """Rows of the packed batch (offsets into input_ids)."""
    target_ids: list[int]
    """The prompt token each row's distribution is scored on (the next one)."""
    owners: list[tuple[Sequence, int]]
    """(sequence, number of its rows), in row order."""
    num_top: int
    """The most top alternatives any owner asked for."""


class PromptLogprobTracker:
    """The sequences still missing prompt log-probabilities, so that a step where there are
    none (the common case) costs one set test instead of a pass over the batch."""

    def __init__(self) -> None:
        self.missing: set[int] = set()

    def admit(self, seq: Sequence) -> None:
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            self.missing.add(seq.seq_id)

    def release(self, seq: Sequence) -> None:
        self.missing.discard(seq.seq_id)

    def plan(self, batch: ScheduledBatch) -> PromptLogprobRows | None:
        """The rows this batch must score, or None."""
        if not self.missing:
            return None
        plan = PromptLogprobRows([], [], [], 0)
        offset = 0
        for seq, num_tokens in zip(batch.seqs, batch.num_tokens, strict=True):
            if seq.seq_id in self.missing:
                start = seq.num_computed_tokens
                _add_rows(plan, seq, offset, start, start + num_tokens)
            offset += num_tokens
        return plan if plan.rows else None

    def record(self, logits: torch.Tensor, plan: PromptLogprobRows) -> None:
        record_prompt_logprobs(logits, plan)
        for seq, _ in plan.owners:
            if len(seq.prompt_logprobs) == seq.num_prompt_tokens:
                self.missing.discard(seq.seq_id)


def _add_rows(plan: PromptLogprobRows, seq: Sequence, offset: int, start: int, end: int) -> None:
    # Position p scores prompt token p + 1; the first missing entry is token len(list).
    first = len(seq.prompt_logprobs) - 1
    last = min(end, seq.num_prompt_tokens - 1)
    if first >= last:
        return
    assert start <= first, (
        f"sequence {seq.seq_id}: prompt logprobs from position {first} are needed but the "
        f"prefill starts at {start} (a prefix cache must not skip them)")
    plan.rows.extend(range(offset + first - start, offset + last - start))
    plan.target_ids.extend(seq.token_ids[first + 1: last + 1])
    plan.owners.append((seq, last - first))
    plan.num_top = max(plan.num_top, seq.params.prompt_logprobs)


def record_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobRows) -> None:
    """Score the rows `[R, V]` and append one {token id: logprob} entry per row to its owner."""
    assert logits.shape[0] == len(plan.rows)
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(plan.target_ids, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top_ids: list[list[int]] = [[] for _ in plan.rows]
    top_values: list[list[float]] = [[] for _ in plan.rows]
    if plan.num_top:
        top = logprobs.topk(plan.num_top, dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    row = 0
    for seq, num_rows in plan.owners:
        k = seq.params.prompt_logprobs
        for j in range(row, row + num_rows):
            entry = dict(zip(top_ids[j][:k], top_values[j][:k], strict=True))
            entry[plan.target_ids[j]] = chosen[j]
            seq.prompt_logprobs.append(entry)
        row += num_rows
