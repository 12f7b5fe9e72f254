"""The drafts of the next step, made after a speculative step's update: the MTP layer over the
positions each sequence committed (from the step's graphs when it ran in them, else a forward
of its own), then the chained draft steps; and how many drafts a sequence may take.

The MTP layer's row at position p joins the main model's state at p to the embedding of token
p + 1. A prefix-cache hit of h tokens starts the MTP layer at h, so its row h - 1 (cache latent
and indexer key) is the one the cached request computed from ITS token h; where the new
request's token h differs (a prompt that extends a cached prompt with other words than the
cached request's first output), that one row differs from a run without the cache. Drafts are
verified, so the tokens do not change (tests/engine/test_speculative.py); only drafts that
attend to the row may. Refusing such hits would cost the common case instead: a chat's next
turn renders the earlier answer in the template's form, often not token for token what was
sampled at the prompt's end. Rebuilding the row needs the main model's state at h - 1 and the
MTP indexer tail before it, which the snapshots do not keep."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from glmflash.engine.scheduler import ScheduledBatch, Scheduler
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_policy import DraftPolicy
from glmflash.engine.spec_rows import gather_pieces, keeps_mtp_cache, never_drafts
from glmflash.engine.spec_runner import MainOutput, MtpRows, SpecRunner

if TYPE_CHECKING:
    from glmflash.engine.cache import CacheManager
    from glmflash.engine.spec_graphs import GreedyStep


class SpecStep(NamedTuple):
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


class Drafter:
    """Makes each sequence's drafts for the next step (`Sequence.draft_ids`)."""

    def __init__(self, runner: SpecRunner, scheduler: Scheduler, cache: CacheManager,
                 policy: DraftPolicy, num_steps: int, max_seq_len: int) -> None:
        self.runner, self.scheduler, self.cache, self.policy = runner, scheduler, cache, policy
        self.num_steps, self.max_seq_len = num_steps, max_seq_len

    def after(self, step: SpecStep) -> None:
        """The MTP layer over what `step` committed, and the drafts of the live sequences."""
        if step.greedy is not None:
            self._after_greedy(step)
            return
        if step.main is None and self.runner.last_verify is not None:
            self._after_graph(step)
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

    def _after_greedy(self, step: SpecStep) -> None:
        """The drafts the greedy step's draft graph made, then the chained steps."""
        seqs, greedy = step.batch.seqs, step.greedy
        drafting = self._drafting(seqs, [not seq.is_finished for seq in seqs])
        if not drafting:
            return
        drafts = [[greedy.drafted[b]] for b in drafting]
        if self.num_steps > 1:
            self._chain([seqs[b] for b in drafting], greedy.draft_outputs(drafting), drafts)
        for b, draft in zip(drafting, drafts, strict=True):
            seqs[b].draft_ids = draft

    def _after_graph(self, step: SpecStep) -> None:
        """After a replayed verify (every sequence verified all its drafts): the draft graph
        over the committed positions, then the chained steps."""
        seqs = step.batch.seqs
        live = [not seq.is_finished and self.keeps_mtp_cache(seq, start)
                for seq, start in zip(seqs, step.starts, strict=True)]
        out, first = self.runner.draft_verified(seqs, step.starts, step.committed, live)
        drafting = self._drafting(seqs, live)
        if not drafting:
            return
        drafts = [[first[b]] for b in drafting]
        self._chain([seqs[b] for b in drafting], out[drafting], drafts)
        for b, draft in zip(drafting, drafts, strict=True):
            seqs[b].draft_ids = draft

    def _drafting(self, seqs: list[Sequence], live: list[bool]) -> list[int]:
        """The indices of the live sequences that draft for the next step."""
        if not self.policy.allows(len(self.scheduler.running)):
            return []
        return [b for b, seq in enumerate(seqs) if live[b] and self.draft_budget(seq) > 0]

    def _mtp_rows(self, step: SpecStep) -> tuple[MtpRows, list[Sequence]]:
        """The positions each live sequence that keeps the MTP layer's cache committed
        (drafting sequences first), with their main hidden states."""
        drafting, others = [], []
        allowed = self.policy.allows(len(self.scheduler.running))
        for i, seq in enumerate(step.batch.seqs):
            if seq.is_finished:
                continue
            if allowed and self.draft_budget(seq) > 0:
                drafting.append(i)
            elif self.keeps_mtp_cache(seq, step.starts[i]):
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

    def draft_budget(self, seq: Sequence) -> int:
        """Drafts a sequence may take now: up to num_steps, never past its max_tokens or the
        context; none for a prefill, or under penalties or logits processors (they depend on
        the tokens before each draft)."""
        params = seq.params
        if seq.num_uncomputed_tokens != 1 or seq.num_computed_tokens < seq.num_prompt_tokens \
                or never_drafts(seq):
            return 0
        return max(0, min(self.num_steps, params.max_tokens - seq.num_output_tokens - 1,
                          self.max_seq_len - seq.num_tokens - 1))

    def keeps_mtp_cache(self, seq: Sequence, start: int) -> bool:
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
        budget = self.draft_budget(seq)
        if budget > 1 and self.cache.can_append(seq, budget - 1):
            self.cache.append(seq, budget - 1)
            return budget
        return 1
