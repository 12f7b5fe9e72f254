"""The device side of speculative decoding, beside the ModelRunner: the MTP layer, the verify
forward (model/verify.py) and its commit, and the MTP layer's forwards that draft.

The MTP layer's cache is one more MLA layer of the runner's ModelState (`with_mtp_layer`): its
latents use the sequence's own pages and its indexer tail the sequence's state slot. MTP
position p holds (main hidden state at p, embedding of token p+1) and predicts token p+2.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from glmflash.engine.model_runner import ModelRunner
from glmflash.engine.options import EngineConfig
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_draft_graph import DraftGraphMixin
from glmflash.model.dummy_weights import fill_dummy_weights
from glmflash.model.forward_batch import ForwardBatch, build_forward_batch, token_slots_of
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.layers import stack_weights
from glmflash.model.mtp import GlmMtp, load_mtp
from glmflash.model.verify import (
    VerifyHostRows,
    VerifyScratch,
    commit,
    pack_verify,
    verify_batch,
    verify_rows,
)
from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.engine.spec_graphs import CapturedVerify, GreedyStep, SpecGraphRunner

logger = logging.getLogger(__name__)
MTP_DUMMY_SEED = 1


def load_mtp_module(path: Path, model: GlmForCausalLM, device: torch.device,
                    options: EngineConfig) -> GlmMtp:
    """The checkpoint's MTP layer (or dummy weights), wholly on `device`: with CPU experts
    (hybrid) its own experts still stay on the GPU, where every draft step reads them."""
    with torch.device(device):
        mtp = GlmMtp(model.config, model.dtype)
    if options.load_format == "dummy":
        fill_dummy_weights(mtp, seed=MTP_DUMMY_SEED)
    else:
        load_mtp(mtp, path)
    if device.type == "cpu":
        experts = mtp.layer.mlp.experts
        if experts.gate_proj.fp8_block:
            experts.build_cpu_kernel(options.kt_cpuinfer, options.kt_threadpool_count).warmup()
    stack_weights(mtp)
    logger.info("MTP layer %d loaded for speculative decoding (%d drafts per step)",
                model.config.num_hidden_layers, options.num_speculative_steps)
    return mtp.eval()


class MainOutput(NamedTuple):
    hidden: torch.Tensor
    """`[T, D]` main-model hidden state of every token of the forward."""
    logits: torch.Tensor
    """`[N, V]` logits of the rows to sample."""
    cu_seqlens: list[int]
    """Each sequence's rows in `hidden`."""


class MtpRows(NamedTuple):
    """One MTP forward: sequence b covers MTP positions `starts[b]..starts[b]+counts[b]-1`."""

    seqs: list[Sequence]
    starts: list[int]
    counts: list[int]
    hidden: torch.Tensor
    """`[sum(counts), D]` the main hidden state at those positions."""


class SpecRunner(DraftGraphMixin):
    def __init__(self, runner: ModelRunner, mtp: GlmMtp, num_steps: int, max_rows: int) -> None:
        self.runner, self.mtp, self.model = runner, mtp, runner.model
        self.state = runner.state
        self.num_steps = num_steps
        self.scratch = VerifyScratch(self.model.config, self.state, max_rows, num_steps)
        self.mtp_layer = self.model.config.num_hidden_layers
        self.graphs: SpecGraphRunner | None = None
        """The captured verify and draft forwards (`capture_graphs`)."""
        self.last_verify: CapturedVerify | None = None
        """The graph the latest verify replayed, or None when it ran eagerly."""

    @torch.inference_mode()
    def forward_main(self, batch: ScheduledBatch) -> MainOutput:
        """Prefill chunks (and decodes without drafts) as the runner lays them out, keeping
        the hidden states; prompt log-probabilities are recorded on the way."""
        runner = self.runner
        prompt_rows = runner.prompt_logprobs.plan(batch)
        fb = runner.prepare(batch, prompt_rows.rows if prompt_rows is not None else None)
        hidden = self.model.hidden_states(fb, self.state)
        logits = self.model.logits(hidden[fb.logits_index])
        if prompt_rows is not None:
            num_sampled = logits.shape[0] - len(prompt_rows.rows)
            runner.prompt_logprobs.record(logits[num_sampled:], prompt_rows)
            logits = logits[:num_sampled]
        cu = fb.cu_seqlens if fb.cu_seqlens is not None else list(range(len(batch.seqs) + 1))
        return MainOutput(hidden, logits, cu)

    @torch.inference_mode()
    def forward_plain(self, batch: ScheduledBatch) -> MainOutput:
        """A step without drafts, keeping the hidden states: a decode graph's replay when one
        holds the batch, else `forward_main`."""
        runner = self.runner
        step = runner.decode_step(batch) if runner.prompt_logprobs.plan(batch) is None else None
        captured = runner.replay_decode(step) if step is not None else None
        if captured is None:
            return self.forward_main(batch)
        num = len(batch.seqs)
        return MainOutput(captured.hidden[:num], captured.logits[:num], list(range(num + 1)))

    @torch.inference_mode()
    def capture_graphs(self, batch_sizes: list[int]) -> None:
        """Capture the verify and draft forwards (after the runner's decode graphs, into their
        memory pool)."""
        from glmflash.engine.spec_graphs import SpecGraphRunner

        self.graphs = SpecGraphRunner(self, batch_sizes, self.num_steps)
        decode = self.runner.graphs
        self.graphs.capture(decode.pool if decode is not None else None)

    @torch.inference_mode()
    def forward_verify(self, seqs: list[Sequence], drafts: list[list[int]]) -> MainOutput:
        """Each sequence's last token and its drafts in one forward: logits of every row.
        Replayed from a graph when one holds the batch (`last_verify` is then that graph,
        whose hidden states the draft graph reads)."""
        rows = self.verify_rows(seqs, drafts)
        cu = np.cumsum([0, *rows.num_tokens]).tolist()
        self.last_verify = None
        if self.graphs is not None and self.graphs.fits(len(seqs), drafts):
            self.last_verify = captured = self.graphs.replay_verify(rows)
            full = self.graphs.rows_per_seq
            if all(n == full for n in rows.num_tokens):
                return MainOutput(captured.hidden[: cu[-1]], captured.logits[: cu[-1]], cu)
            # Rows past a sequence's drafts are padding in the graph's layout.
            index = self._graph_rows(rows.num_tokens)
            return MainOutput(captured.hidden.index_select(0, index),
                              captured.logits.index_select(0, index), cu)
        runner = self.runner
        fb = verify_batch(upload(pack_verify(rows, save=True), runner.device), rows.num_tokens,
                          runner.page_table, runner.page_size,
                          runner.pool_width(rows.num_pools), self.scratch)
        hidden = self.model.hidden_states(fb, self.state)
        return MainOutput(hidden, self.model.logits(hidden), cu)

    @torch.inference_mode()
    def verify_greedy(self, seqs: list[Sequence], drafts: list[list[int]],
                      forced: list[int] | None, blocking: bool) -> GreedyStep:
        """A step of greedy sequences with all their drafts, wholly in graphs: verify, accept,
        commit and draft (engine/spec_graphs.py `replay_greedy`)."""
        self.last_verify = None
        return self.graphs.replay_greedy(self.verify_rows(seqs, drafts), forced, blocking)

    def verify_rows(self, seqs: list[Sequence], drafts: list[list[int]]) -> VerifyHostRows:
        page = self.runner.page_size
        ids, slots, starts = [], [], []
        for seq, draft in zip(seqs, drafts, strict=True):
            start = seq.num_computed_tokens
            ids.append([seq.token_ids[start], *draft])
            slots.append(token_slots_of(seq.page_ids, start, 1 + len(draft), page).tolist())
            starts.append(start)
        ends = [start + len(i) for start, i in zip(starts, ids, strict=True)]
        return verify_rows(ids, slots, starts, [s.state_slot for s in seqs],
                           max(ends) // self.model.config.index_kpool)

    @torch.inference_mode()
    def draft_verified(self, seqs: list[Sequence], starts: list[int], committed: list[int],
                       live: list[bool]) -> tuple[torch.Tensor, list[int]]:
        """The draft graph after a replayed verify of `seqs`: the MTP layer over each live
        sequence's committed positions `starts[b]..starts[b]+committed[b]-1` (padding rows
        elsewhere). Returns, per sequence, the layer's output at its last committed row
        `[B, D]` and the id drafted there."""
        graphs = self.graphs
        counts = [count if is_live else 0 for count, is_live in zip(committed, live, strict=True)]
        # The graph runner pads each sequence's rows to k + 1 (and the batch to its size).
        rows = self._committed_rows(seqs, starts, counts, 0)
        num = graphs.rows_per_seq * len(seqs)
        captured = graphs.replay_draft(rows, self.last_verify)
        picks = [b * graphs.rows_per_seq + max(c, 1) - 1 for b, c in enumerate(committed)]
        drafted = captured.ids[:num].tolist()
        return captured.out[upload(picks, self.runner.device)], [drafted[r] for r in picks]

    def _committed_rows(self, seqs: list[Sequence], starts: list[int], counts: list[int],
                        num_pools: int) -> VerifyHostRows:
        """Rows of the MTP layer over positions `starts[b]..starts[b]+counts[b]-1` of each
        sequence, each with the token after it."""
        page = self.runner.page_size
        return verify_rows(
            [seq.token_ids[start + 1: start + 1 + n].tolist()
             for seq, start, n in zip(seqs, starts, counts, strict=True)],
            [token_slots_of(seq.page_ids, start, n, page).tolist()
             for seq, start, n in zip(seqs, starts, counts, strict=True)],
            starts, [seq.state_slot for seq in seqs], num_pools)

    def commit(self, seqs: list[Sequence], drafts: list[list[int]],
               num_accepted: list[int]) -> None:
        """Each verified sequence's fixed-size state after its last accepted token."""
        commit(self.state, self.scratch, [s.state_slot for s in seqs],
               [1 + len(d) for d in drafts], num_accepted)

    @torch.inference_mode()
    def draft_extend(self, rows: MtpRows, num_drafting: int) -> tuple[torch.Tensor, list[int]]:
        """The MTP layer over the positions each sequence committed; the first `num_drafting`
        sequences draft from their last row. Returns their pre-norm MTP output `[n, D]` (the
        next chained step's hidden state) and the drafted ids."""
        page = self.runner.page_size
        ids, slots, cu = [], [], [0]
        for seq, start, count in zip(rows.seqs, rows.starts, rows.counts, strict=True):
            ids += seq.token_ids[start + 1: start + 1 + count].tolist()
            slots += token_slots_of(seq.page_ids, start, count, page).tolist()
            cu.append(cu[-1] + count)
        fb = build_forward_batch(ids, slots, cu, rows.starts, [s.state_slot for s in rows.seqs],
                                 self.runner.page_table, page,
                                 logit_seqs=list(range(num_drafting)))
        embeds = self._next_embeds(fb, rows)
        return self._draft(rows.hidden, embeds, fb)

    @torch.inference_mode()
    def draft_chain(self, seqs: list[Sequence], positions: list[int], hidden: torch.Tensor,
                    previous: list[int]) -> tuple[torch.Tensor, list[int]]:
        """One chained draft step: MTP position `positions[b]` from the previous step's output
        and draft. The caller restores the MTP layer's tail afterwards (`save_mtp_tail`)."""
        page = self.runner.page_size
        slots = [token_slots_of(s.page_ids, p, 1, page)[0] for s, p in
                 zip(seqs, positions, strict=True)]
        fb = build_forward_batch(previous, slots, list(range(len(seqs) + 1)), positions,
                                 [s.state_slot for s in seqs], self.runner.page_table, page)
        return self._draft(hidden, self.model.text.embed_tokens(fb.input_ids), fb)

    def save_mtp_tail(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer's indexer tail of `seqs`, for `restore_mtp_tail` after chained steps
        (whose draft tokens must not stay in it)."""
        slots = upload([s.state_slot for s in seqs], self.runner.device)
        return slots, self.state.index_tail[self.mtp_layer][slots].clone()

    def restore_mtp_tail(self, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        slots, rows = saved
        self.state.index_tail[self.mtp_layer][slots] = rows

    def apply_page_updates(self, updates: list[tuple[int, int, int]]) -> None:
        self.runner.apply_page_updates(updates)

    def _draft(self, hidden: torch.Tensor, embeds: torch.Tensor,
               fb: ForwardBatch) -> tuple[torch.Tensor, list[int]]:
        out = self.mtp.layer.hidden(hidden, embeds, fb, self.state)[fb.logits_index]
        if not out.shape[0]:
            return out, []
        return out, self.mtp.logits(self.model, out).argmax(dim=-1).tolist()

    def _next_embeds(self, fb: ForwardBatch, rows: MtpRows) -> torch.Tensor:
        """Embeddings of the next tokens, with a multimodal prompt's visual rows where the next
        token is one of its media tokens."""
        embeds = self.model.text.embed_tokens(fb.input_ids)
        for b, (seq, start, count) in enumerate(zip(rows.seqs, rows.starts, rows.counts,
                                                    strict=True)):
            end = min(start + 1 + count, seq.num_prompt_tokens)
            if seq.prompt_embeds is not None and start + 1 < end:
                first = fb.cu_seqlens[b]
                embeds[first: first + end - start - 1] = \
                    seq.prompt_embeds[start + 1: end].to(embeds)
        return embeds


def gather_rows(hidden: torch.Tensor, first_rows: list[int], counts: list[int]) -> torch.Tensor:
    """Rows `first..first+count-1` of `hidden` for each (first, count), back to back."""
    index = np.concatenate([np.arange(f, f + c) for f, c in zip(first_rows, counts, strict=True)]
                           ) if counts else np.zeros(0, np.int64)
    return hidden.index_select(0, upload(index, hidden.device))
