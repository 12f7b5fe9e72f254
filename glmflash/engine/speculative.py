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
from typing import TYPE_CHECKING

import torch

from glmflash.engine.sampler import Sampler, unpack
from glmflash.engine.scheduler import ScheduledBatch, Scheduler, TokenDelta
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_drafts import Drafter, SpecStep
from glmflash.engine.spec_policy import DraftPolicy, SpecCounters
from glmflash.engine.spec_rows import SampleRows, batch_part, is_verify, never_drafts
from glmflash.engine.spec_runner import SpecRunner

if TYPE_CHECKING:
    from glmflash.engine.cache import CacheManager

logger = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, runner: SpecRunner, scheduler: Scheduler, cache: CacheManager,
                 sampler: Sampler, num_steps: int, policy: DraftPolicy,
                 max_seq_len: int) -> None:
        self.runner, self.scheduler, self.sampler, self.policy = runner, scheduler, sampler, policy
        self.counters = SpecCounters.empty(num_steps)
        self.verified: dict[int, tuple[int, int]] = {}
        """seq id -> (drafts, accepted) of this step's verify, counted once the engine knows
        how many of the run's tokens the sequence kept (`count_output`)."""
        self.drafter = Drafter(runner, scheduler, cache, policy, num_steps, max_seq_len)
        self._step: SpecStep | None = None
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
        self.verified.clear()  # and verifies of sequences that output nothing
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
                self.drafter.keeps_mtp_cache(seq, start)
                for seq, start in zip(batch.seqs, starts, strict=True)):
            return self.runner.runner.run(batch)
        main = self.runner.forward_plain(batch)
        self._step = SpecStep(batch, starts, list(batch.num_tokens), main,
                              {i: i for i in range(len(batch.seqs))}, None, {}, {},
                              is_plain=True)
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
            self._note_verified([batch.seqs[i] for i in verify_idx],
                                [drafts[i] for i in verify_idx], accepted)
        committed = list(batch.num_tokens)
        for i, a in zip(verify_idx, accepted, strict=True):
            committed[i] = 1 + a
        self._step = SpecStep(batch, starts, committed, main,
                              {i: k for k, i in enumerate(main_idx)}, verify,
                              {i: k for k, i in enumerate(verify_idx)}, logprobs)
        return runs

    def _verify_greedy(self, batch: ScheduledBatch, drafts: list[list[int]],
                       starts: list[int]) -> list[list[int]]:
        """Every sequence greedy with all its drafts: one pass through the graphs, one wait."""
        forced = [self.accept_override(d) for d in drafts] \
            if self.accept_override is not None else None
        step = self.runner.verify_greedy(batch.seqs, drafts, forced,
                                         self.sampler.sleep_while_waiting)
        self.sampler.errors = {}
        self._note_verified(batch.seqs, drafts, step.accepted)
        committed = [1 + a for a in step.accepted]
        self._step = SpecStep(batch, starts, committed, None, {}, None, {}, {}, step)
        return [targets[: a + 1] for targets, a in zip(step.targets, step.accepted, strict=True)]

    @staticmethod
    def _all_greedy(seqs: list[Sequence]) -> bool:
        """Whether every sequence takes the argmax of its raw logits (what the graphs' greedy
        acceptance computes): greedy, no logprobs, no penalties or logits processors."""
        return all(s.params.is_greedy and s.params.logprobs is None and not never_drafts(s)
                   for s in seqs)

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
        self.drafter.after(step)

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

    def _note_verified(self, seqs: list[Sequence], drafts: list[list[int]],
                       accepted: list[int]) -> None:
        """The policy sees every verified draft (how good the drafts are); the counters wait
        for `count_output`."""
        first_drafts = first_accepted = 0
        for seq, draft, a in zip(seqs, drafts, accepted, strict=True):
            if not draft:
                continue
            self.verified[seq.seq_id] = (len(draft), a)
            first_drafts += 1
            first_accepted += int(a > 0)
        self.policy.observe(first_drafts, first_accepted)

    def count_output(self, seq: Sequence, num_kept: int) -> None:
        """Count `seq`'s verify of this step once `num_kept` of its run's tokens are output (a
        stop token or string may end the run inside its accepted drafts). The figures count
        what the output got: a run cut there counts its last kept token as the step's own and
        the drafts before it as accepted, so that every verify step counts its accepted drafts
        plus one token, as many as it output; drafts past the end count nowhere."""
        counts = self.verified.pop(seq.seq_id, None)
        if counts is None or num_kept < 1:
            return
        num_drafts, accepted = counts
        if num_kept <= accepted:
            num_drafts = accepted = num_kept - 1
        seq.num_verify_steps += 1
        seq.num_draft_tokens += num_drafts
        seq.num_accepted_tokens += accepted
        self.counters = self.counters.add(num_drafts, accepted)
