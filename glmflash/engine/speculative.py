"""Speculative decoding with the checkpoint's MTP layer (NEXTN): draft, verify, accept.

A step with drafts runs up to two forwards: the prefill chunks as always, and the verify forward
of the decodes (each sequence's last token plus its drafts, model/verify.py). Every row of a
verified sequence is sampled as a plain step would sample it at that output position (the same
seeded noise); drafts are accepted while they equal those tokens, and the first token that
differs ends the run. With a greedy draft (one token) this is the standard rejection rule:
draft t is kept with probability p(t), and otherwise the token comes from p without t,
renormalised, which is `max(p - onehot(t), 0)` normalised; so sampling keeps its distribution
and greedy output is the target's own. Then the fixed-size state is committed at the accepted
position, the scheduler appends the run (a stop condition cuts it), and the MTP layer runs over
the positions each sequence committed: its last row drafts the next token, and chained steps
(`--speculative-num-steps` > 1) feed the layer its own output and draft.

While drafting is held off (the speed check, the acceptance pause, a batch above
`--speculative-max-batch-size`), steps run without drafts (`run_plain`: a decode graph when one
holds the batch) but keep their hidden states, and the MTP layer still runs over the positions
committed by every sequence that may draft later, from the draft graphs when the rows fit them:
one MTP forward per step, so that drafting resumes over a complete cache (rebuilding the missed
positions later would need the main model's hidden states there, prompts included). A request
that never drafts (penalties, logits processors) pays for no MTP forward past its prompt, whose
pages the prefix cache may share (`spec_rows.keeps_mtp_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from glmflash.engine.sampler import Sampler, unpack
from glmflash.engine.scheduler import ScheduledBatch, Scheduler, TokenDelta
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_policy import DraftPolicy, SpecCounters
from glmflash.engine.spec_rows import (
    SampleRows,
    batch_part,
    gather_pieces,
    is_verify,
    keeps_mtp_cache,
    never_drafts,
)
from glmflash.engine.spec_runner import MainOutput, MtpRows, SpecRunner

if TYPE_CHECKING:
    from glmflash.engine.cache import CacheManager
    from glmflash.engine.spec_graphs import GreedyStep

logger = logging.getLogger(__name__)


class _Step(NamedTuple):
    """What a verify step leaves for the drafting after the scheduler's update."""

    batch: ScheduledBatch
    starts: list[int]
    """Each sequence's computed tokens before the step."""
    committed: list[int]
    """Positions each sequence computed for good this step."""
    main: MainOutput | None
    main_rows: dict[int, int]
    """Batch index -> its sequence's index in the main forward."""
    verify: MainOutput | None
    verify_rows: dict[int, int]
    logprobs: dict[int, list]
    """seq id -> logprob entries of its run (cut to the tokens the update kept)."""
    greedy: GreedyStep | None = None
    """Set when the step ran wholly in graphs (its drafts are already made)."""
    is_plain: bool = False
    """A step without drafts while drafting was held off (`run_plain`)."""


class SpecDecoder:
    def __init__(self, runner: SpecRunner, scheduler: Scheduler, cache: CacheManager,
                 sampler: Sampler, num_steps: int, policy: DraftPolicy,
                 max_seq_len: int) -> None:
        self.runner, self.scheduler, self.cache, self.sampler = runner, scheduler, cache, sampler
        self.num_steps, self.policy, self.max_seq_len = num_steps, policy, max_seq_len
        self.counters = SpecCounters.empty(num_steps)
        self._step: _Step | None = None
        self.accept_override: Callable[[list[int]], int] | None = None
        """Benchmarks (bench/e2e_mtp.py): the drafts a sequence accepts, given its drafts, in
        place of comparing them with the sampled tokens."""
        self.fills_held_off = True
        """False (benchmarks: the MTP-off side of bench/e2e_mtp.py): steps held off run as
        without speculative decoding, leaving the MTP layer's cache behind."""

    def wants(self, batch: ScheduledBatch) -> bool:
        """This step takes the speculative path: it verifies drafts, or drafting is on and a
        sequence of the batch may draft."""
        self._step = None  # what a failed step may have left
        self.policy.tick()
        allowed = self.policy.allows(len(self.scheduler.running))
        return batch.draft_ids is not None or \
            (allowed and not all(never_drafts(seq) for seq in batch.seqs))

    def run_plain(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of a step off the speculative path. Its hidden states are kept for
        `after_update`, which runs the MTP layer over what the sequences that keep its cache
        committed; a step with none of them runs as without speculative decoding."""
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        if not self.fills_held_off or not any(
                self._keeps_mtp_cache(seq, start)
                for seq, start in zip(batch.seqs, starts, strict=True)):
            return self.runner.runner.run(batch)
        main = self.runner.forward_plain(batch)
        self._step = _Step(batch, starts, list(batch.num_tokens), main,
                           {i: i for i in range(len(batch.seqs))}, None, {}, {}, is_plain=True)
        return main.logits

    def verify(self, batch: ScheduledBatch, sampled: list[Sequence]) -> list[list[int]]:
        """The step's forwards and the accepted run of every sampled sequence (in order).
        Rows whose logits processor raised are in `sampler.errors`, by sampled index."""
        self.runner.runner.apply_cache_changes(batch.page_updates, batch.cache_ops)
        drafts = batch.draft_ids or [[] for _ in batch.seqs]
        verifies = [is_verify(seq, n, sample, d) for seq, n, sample, d in
                     zip(batch.seqs, batch.num_tokens, batch.needs_sample, drafts, strict=True)]
        main_idx = [i for i, v in enumerate(verifies) if not v]
        verify_idx = [i for i, v in enumerate(verifies) if v]
        starts = [seq.num_computed_tokens for seq in batch.seqs]
        for seq in batch.seqs:
            seq.draft_ids = []
        if not main_idx and self._all_greedy(batch.seqs) and \
                self.runner.graphs is not None and self.runner.graphs.fits(len(drafts), drafts):
            return self._verify_greedy(batch, drafts, starts)
        main = self.runner.forward_main(batch_part(batch, main_idx)) if main_idx else None
        verify = self.runner.forward_verify([batch.seqs[i] for i in verify_idx],
                                            [drafts[i] for i in verify_idx]) \
            if verify_idx else None
        rows = SampleRows.of(batch, drafts, main_idx, verify_idx, main, verify)
        runs, logprobs = self._accept(rows, sampled, drafts)
        accepted = [len(runs[rows.sampled_of[i]]) - 1 for i in verify_idx]
        if verify_idx:
            self.runner.commit([batch.seqs[i] for i in verify_idx],
                               [drafts[i] for i in verify_idx], accepted)
            self._count([batch.seqs[i] for i in verify_idx], [drafts[i] for i in verify_idx],
                        accepted)
        committed = list(batch.num_tokens)
        for i, a in zip(verify_idx, accepted, strict=True):
            committed[i] = 1 + a
        self._step = _Step(batch, starts, committed, main, {i: k for k, i in enumerate(main_idx)},
                           verify, {i: k for k, i in enumerate(verify_idx)}, logprobs)
        return runs

    def _verify_greedy(self, batch: ScheduledBatch, drafts: list[list[int]],
                       starts: list[int]) -> list[list[int]]:
        """Every sequence greedy with all its drafts: one pass through the graphs, one wait."""
        forced = [self.accept_override(d) for d in drafts] \
            if self.accept_override is not None else None
        step = self.runner.verify_greedy(batch.seqs, drafts, forced,
                                         self.sampler.sleep_while_waiting)
        self.sampler.errors = {}
        self._count(batch.seqs, drafts, step.accepted)
        committed = [1 + a for a in step.accepted]
        self._step = _Step(batch, starts, committed, None, {}, None, {}, {}, step)
        return [targets[: a + 1] for targets, a in zip(step.targets, step.accepted, strict=True)]

    @staticmethod
    def _all_greedy(seqs: list[Sequence]) -> bool:
        return all(s.params.is_greedy and s.params.logprobs is None for s in seqs)

    def after_update(self, deltas: list[TokenDelta]) -> None:
        """Logprobs of the tokens kept; then the MTP layer over the committed positions, and
        the drafts of the next step."""
        step, self._step = self._step, None
        if step is None:
            return
        for delta in deltas:
            entries = step.logprobs.get(delta.seq.seq_id)
            if entries is not None:
                delta.seq.logprobs.extend(entries[: len(delta.token_ids)])
        if step.greedy is not None:
            self._draft_after_greedy(step)
            return
        if step.main is None and self.runner.last_verify is not None:
            self._draft_after_graph(step)
            return
        rows, drafting = self._mtp_rows(step)
        if not rows.seqs:
            return
        in_graph = step.is_plain and self.runner.fits_draft_graph(rows)
        run_mtp = self.runner.draft_in_graph if in_graph else self.runner.draft_extend
        hidden, first = run_mtp(rows, len(drafting))
        drafts = [[t] for t in first]
        self._chain(drafting, hidden, drafts)
        for seq, draft in zip(drafting, drafts, strict=True):
            seq.draft_ids = draft

    def observe_speed(self, batch: ScheduledBatch, speculative: bool, num_tokens: int,
                      seconds: float) -> None:
        """A step of decodes only took `seconds` for `num_tokens`: the policy compares steps
        that verified drafts with plain ones (steps on the speculative path without drafts,
        while drafting starts, are neither)."""
        drafted = batch.draft_ids is not None and any(batch.draft_ids)
        if drafted or not speculative:
            self.policy.speed.observe(drafted, len(batch.seqs), num_tokens, seconds)

    def stats(self) -> SpecCounters:
        return self.counters.with_drafting(self.policy.is_drafting)

    def _accept(self, rows: SampleRows, sampled: list[Sequence],
                drafts: list[list[int]]) -> tuple[list[list[int]], dict[int, list]]:
        """Sample every row; each sequence's run: its drafts while they equal the sampled
        tokens, then the first sampled token that differs (or the one after the last draft)."""
        out = self.sampler.sample_on_device(rows.logits, rows.seqs, rows.offsets)
        token_ids, entries = unpack(out)
        self.sampler.errors = {rows.sampled_of_row[r]: e for r, e in out.errors.items()}
        runs, logprobs = [], {}
        for k, seq in enumerate(sampled):
            first, draft = rows.first_row[k], rows.drafts_of[k]
            targets = token_ids[first: first + len(draft) + 1]
            accepted = self.accept_override(draft) if self.accept_override is not None \
                else self.count_accepted(draft, targets)
            runs.append(targets[: accepted + 1])
            if seq.params.logprobs is not None:
                logprobs[seq.seq_id] = entries[first: first + accepted + 1]
        return runs, logprobs

    @staticmethod
    def count_accepted(draft: list[int], targets: list[int]) -> int:
        """Leading drafts equal to the tokens sampled at their positions (`targets` has one
        more: the token after the last draft)."""
        accepted = 0
        while accepted < len(draft) and targets[accepted] == draft[accepted]:
            accepted += 1
        return accepted

    def _count(self, seqs: list[Sequence], drafts: list[list[int]],
               accepted: list[int]) -> None:
        first_drafts = first_accepted = 0
        for seq, draft, a in zip(seqs, drafts, accepted, strict=True):
            if not draft:
                continue
            seq.num_verify_steps += 1
            seq.num_draft_tokens += len(draft)
            seq.num_accepted_tokens += a
            self.counters = self.counters.add(len(draft), a)
            first_drafts += 1
            first_accepted += int(a > 0)
        self.policy.observe(first_drafts, first_accepted)

    def _draft_after_greedy(self, step: _Step) -> None:
        """The drafts the greedy step's draft graph made, then the chained steps."""
        seqs, greedy = step.batch.seqs, step.greedy
        allowed = self.policy.allows(len(self.scheduler.running))
        drafting = [b for b, seq in enumerate(seqs)
                    if not seq.is_finished and allowed and self._draft_budget(seq) > 0]
        if not drafting:
            return
        drafts = [[greedy.drafted[b]] for b in drafting]
        if self.num_steps > 1:
            self._chain([seqs[b] for b in drafting], greedy.draft_outputs(drafting), drafts)
        for b, draft in zip(drafting, drafts, strict=True):
            seqs[b].draft_ids = draft

    def _draft_after_graph(self, step: _Step) -> None:
        """After a replayed verify (every sequence verified all its drafts): the draft graph
        over the committed positions, then the chained steps."""
        seqs = step.batch.seqs
        live = [not seq.is_finished and self._keeps_mtp_cache(seq, start)
                for seq, start in zip(seqs, step.starts, strict=True)]
        out, first = self.runner.draft_verified(seqs, step.starts, step.committed, live)
        allowed = self.policy.allows(len(self.scheduler.running))
        drafting = [b for b, seq in enumerate(seqs)
                    if live[b] and allowed and self._draft_budget(seq) > 0]
        if not drafting:
            return
        drafts = [[first[b]] for b in drafting]
        self._chain([seqs[b] for b in drafting], out[drafting], drafts)
        for b, draft in zip(drafting, drafts, strict=True):
            seqs[b].draft_ids = draft

    def _mtp_rows(self, step: _Step) -> tuple[MtpRows, list[Sequence]]:
        """The positions each live sequence that keeps the MTP layer's cache committed
        (drafting sequences first), with their main hidden states."""
        drafting, others = [], []
        allowed = self.policy.allows(len(self.scheduler.running))
        for i, seq in enumerate(step.batch.seqs):
            if seq.is_finished:
                continue
            if allowed and self._draft_budget(seq) > 0:
                drafting.append(i)
            elif self._keeps_mtp_cache(seq, step.starts[i]):
                others.append(i)
        order = drafting + others
        if not order:
            return MtpRows([], [], [], None), []
        pieces = []
        for i in order:
            out, k = (step.verify, step.verify_rows[i]) if i in step.verify_rows \
                else (step.main, step.main_rows[i])
            pieces.append((out, out.cu_seqlens[k], step.committed[i]))
        hidden = gather_pieces(pieces)
        seqs = [step.batch.seqs[i] for i in order]
        return MtpRows(seqs, [step.starts[i] for i in order], [step.committed[i] for i in order],
                       hidden), seqs[: len(drafting)]

    def _draft_budget(self, seq: Sequence) -> int:
        """Drafts a sequence may take now: up to num_steps, never past its max_tokens or the
        context; none for a prefill, or under penalties or logits processors (they depend on
        the tokens before each draft)."""
        params = seq.params
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
                or never_drafts(seq):
            return 0
        return max(0, min(self.num_steps, params.max_tokens - seq.num_output_tokens - 1,
                          self.max_seq_len - seq.num_tokens - 1))

    def _keeps_mtp_cache(self, seq: Sequence, start: int) -> bool:
        return keeps_mtp_cache(seq, start, self.cache.radix is not None)

    def _chain(self, drafting: list[Sequence], hidden: torch.Tensor,
               drafts: list[list[int]]) -> None:
        """Chained draft steps 2..num_steps for the sequences with budget and pages for them;
        the MTP layer's tail is restored afterwards (its chained positions are drafts)."""
        budgets = [self._chain_budget(seq) for seq in drafting]
        active = [b for b, n in enumerate(budgets) if n > 1]
        if not active:
            return
        self.runner.apply_page_updates(self.cache.take_page_updates())
        saved = self.runner.save_mtp_tail([drafting[b] for b in active])
        hidden = hidden[active]
        for step in range(2, max(budgets) + 1):
            keep = [j for j, b in enumerate(active) if budgets[b] >= step]
            active, hidden = [active[j] for j in keep], hidden[keep]
            seqs = [drafting[b] for b in active]
            hidden, ids = self.runner.draft_chain(
                seqs, [s.num_computed_tokens + step - 2 for s in seqs], hidden,
                [drafts[b][-1] for b in active])
            for b, token in zip(active, ids, strict=True):
                drafts[b].append(token)
        self.runner.restore_mtp_tail(saved)

    def _chain_budget(self, seq: Sequence) -> int:
        """Drafts for `seq` this round, after taking the pages its chained positions need."""
        budget = self._draft_budget(seq)
        if budget > 1 and self.cache.can_append(seq, budget - 1):
            self.cache.append(seq, budget - 1)
            return budget
        return 1
