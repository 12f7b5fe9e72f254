"""Speculative decoding's forwards replayed from CUDA graphs: the verify forward and the MTP
layer's draft forward (and, for greedy steps, the acceptance between them).

A verify of B sequences with up to k drafts is B * (k + 1) decode rows (model/verify.py
`verify_batch`): its inputs live in device tensors, so one recorded forward serves every such
batch once its words are copied in, as the decode graphs do (engine/cuda_graph.py). Graphs are
captured per (batch size, selection width), next to the decode graphs and into their memory
pool. Padding takes the runner's reserved state slot and page: whole padding sequences at
positions 0..k, and the rows after a sequence's own drafts when it has fewer than k (a request
with penalties never drafts, a request near its end drafts less), so one such sequence does not
send the batch to the eager verify; its accepted count never passes its drafts.

The draft forward runs the MTP layer over the same B * (k + 1) rows: it reads the verify graph's
hidden states in place, and the ids the host wrote for each row (the token after it). Rows past
a sequence's committed positions, and every row of a sequence that finished, become padding rows
(reserved slot and page), so the MTP layer's cache and indexer tail advance exactly over the
committed positions and nothing needs to be put back. The graph returns the layer's output of
every row and the drafted id of every row; the host keeps the row of each sequence's last
committed position.

When every sequence is greedy (and asks no logprobs), a third, small graph runs between the two
and the host waits only once per step (`replay_greedy`): it takes each row's argmax, counts the
leading drafts equal to it, commits the fixed-size state on the device (`commit_on_device`) and
writes the draft graph's inputs (the argmax ids, and padding rows past each sequence's accepted
ones) in place. Sampled steps sample on the host between the two graphs (`replay_verify`,
`replay_draft`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from glmflash.engine import spec_capture
from glmflash.engine.spec_capture import CapturedDraft, CapturedVerify
from glmflash.model.verify import VerifyHostRows, pack_verify
from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.engine.graph_handoff import GraphHandOff
    from glmflash.engine.spec_runner import SpecRunner

logger = logging.getLogger(__name__)


class GreedyStep(NamedTuple):
    """What the host reads back after a greedy step's graphs, per sequence."""

    targets: list[list[int]]
    """The argmax of each of its rows: its run is the first `accepted + 1`."""
    accepted: list[int]
    drafted: list[int]
    """The id the MTP layer drafts at its last accepted row."""
    draft: CapturedDraft
    rows_per_seq: int

    def draft_outputs(self, seqs: list[int]) -> torch.Tensor:
        """The MTP layer's output at the last accepted row of sequences `seqs` `[n, D]`."""
        rows = [b * self.rows_per_seq + self.accepted[b] for b in seqs]
        return self.draft.out[upload(rows, self.draft.out.device)]


class SpecGraphRunner:
    """Owns the captured verify and draft graphs of one SpecRunner and their input buffers."""

    def __init__(self, spec: SpecRunner, batch_sizes: list[int], num_steps: int) -> None:
        self.spec, self.runner = spec, spec.runner
        self.batch_sizes, self.rows_per_seq = sorted(batch_sizes), num_steps + 1
        if self.batch_sizes[-1] > spec.scratch.num_rows:
            raise ValueError(f"verify graphs of {self.batch_sizes[-1]} sequences need as many "
                             f"scratch rows; the scratch has {spec.scratch.num_rows}")
        self.verify_graphs: dict[tuple[int, int], CapturedVerify] = {}
        self.num_replays = 0
        self.num_draft_replays = 0
        device = self.runner.device
        self.step_inputs_gpu = torch.zeros(2, self.batch_sizes[-1], dtype=torch.int64,
                                           device=device)
        """What the acceptance graph reads per step (`spec_capture.DRAFTS_ROW`, `FORCED_ROW`):
        each sequence's drafts, and the drafts it accepts regardless of the argmax (the
        benchmark's forced acceptance, bench/e2e_mtp.py; else `ARGMAX_DECIDES`)."""
        self.step_inputs_cpu = spec_capture.staging(self.step_inputs_gpu)
        self._result_host: torch.Tensor | None = None
        self.replay_events: list[tuple[torch.cuda.Event, ...]] | None = None
        """Benchmarks: a list to collect CUDA events (start, verify done, draft done) around
        each greedy step's graphs."""

    def fits(self, num_seqs: int, drafts: list[list[int]]) -> bool:
        """A verify of these drafts replays a graph (a sequence with fewer drafts than the
        graphs' takes padding rows after them)."""
        return bool(self.verify_graphs) and num_seqs <= self.batch_sizes[-1] and \
            all(len(d) < self.rows_per_seq for d in drafts)

    def key(self, num_seqs: int, num_pools: int) -> tuple[int, int]:
        """The (size, width) graph of a batch: the smallest size that holds it, the narrowest
        selection width that holds its pools."""
        return (next(b for b in self.batch_sizes if b >= num_seqs),
                self.runner.pool_width(num_pools))

    def capture(self, pool: tuple[int, int] | None = None) -> None:
        device = self.runner.device
        handoff = self._handoff()
        most_rows = self.batch_sizes[-1] * self.rows_per_seq
        if handoff is not None and handoff.max_rows < most_rows:
            raise RuntimeError(f"the CPU experts' graph hand-off holds {handoff.max_rows} rows; "
                               f"a verify of {self.batch_sizes[-1]} sequences has {most_rows}")
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        self.capture_all(pool)
        torch.cuda.synchronize(device)
        used = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20
        logger.info("CUDA graphs: verify, acceptance and draft of %s sequences x %d tokens x "
                    "selection widths %s, %d graphs captured in %.1f s, %.0f MiB", self.batch_sizes,
                    self.rows_per_seq, self.runner.pool_widths,
                    3 * len(self.verify_graphs), time.perf_counter() - start, used)

    def capture_all(self, pool: tuple[int, int] | None) -> None:
        """The verify, acceptance and draft graphs per (size, width), largest first, into
        `pool`, each three in the order they replay: a graph may take as working memory what
        was free when it was captured, which includes the outputs of graphs captured after it,
        so replaying it after them would overwrite those outputs."""
        for width in reversed(self.runner.pool_widths):
            for size in reversed(self.batch_sizes):
                verify = self._capture_verify(size, width, pool)
                pool = verify.graph.pool()
                self.verify_graphs[(size, width)] = verify
                draft_inputs = upload(pack_verify(self._padded(self._empty(), size), save=False),
                                      self.runner.device)
                verify.accept = spec_capture.capture_accept(
                    self.spec, verify, draft_inputs, width, self.rows_per_seq,
                    self.step_inputs_gpu[:, :size], pool)
                verify.draft = spec_capture.capture_draft(
                    self.spec, draft_inputs, verify, size, width, self.rows_per_seq, pool)

    def replay_verify(self, rows: VerifyHostRows,
                      events: tuple[torch.cuda.Event, ...] | None = None) -> CapturedVerify:
        """Run the verify of `rows` (n sequences of up to k + 1 rows): the graph in whose
        `hidden` and `logits` sequence b has rows b * (k + 1) onwards. `events[0]` is recorded
        once the inputs are staged (benchmarks)."""
        num_seqs = len(rows.num_tokens)
        captured = self.verify_graphs[self.key(num_seqs, rows.num_pools)]
        size = captured.hidden.shape[0] // self.rows_per_seq
        captured.staging.numpy()[:] = pack_verify(self._padded(rows, size), save=True)
        captured.packed.copy_(captured.staging, non_blocking=True)
        _record_event(events, 0)
        handoff = self._handoff()
        if handoff is not None:
            handoff.set_live_rows(num_seqs * self.rows_per_seq)
        captured.graph.replay()
        if handoff is not None:
            handoff.check()
        self.num_replays += 1
        return captured

    def replay_draft(self, rows: VerifyHostRows, verify: CapturedVerify,
                     again: bool = False) -> CapturedDraft:
        """The MTP layer over `rows` (padding rows where nothing is committed), reading the
        hidden states `verify` left. `again`: the host has not waited on the device since this
        graph's previous replay, whose copy from the staging buffer may not have run yet, so
        the words go through a fresh page-locked block."""
        size = verify.hidden.shape[0] // self.rows_per_seq
        captured = verify.draft
        words = pack_verify(self._padded(rows, size), save=False)
        if again:
            captured.packed.copy_(upload(words, captured.packed.device))
        else:
            captured.staging.numpy()[:] = words
            captured.packed.copy_(captured.staging, non_blocking=True)
        captured.graph.replay()
        self.num_draft_replays += 1
        return captured

    def replay_greedy(self, rows: VerifyHostRows, forced: list[int] | None,
                      blocking: bool) -> GreedyStep:
        """The verify, acceptance and draft graphs of greedy sequences back to back, then one
        wait for what the host needs. `forced`: accepted drafts per sequence (benchmarks);
        `blocking`: wait asleep (hybrid hosts keep their cores for the CPU experts)."""
        num_seqs, rows_per_seq = len(rows.num_tokens), self.rows_per_seq
        inputs = self.step_inputs_cpu
        inputs.zero_()
        inputs[spec_capture.DRAFTS_ROW, :num_seqs] = torch.tensor(rows.num_tokens) - 1
        inputs[spec_capture.FORCED_ROW] = spec_capture.ARGMAX_DECIDES
        if forced is not None:
            inputs[spec_capture.FORCED_ROW, :num_seqs] = torch.tensor(forced)
        self.step_inputs_gpu.copy_(inputs, non_blocking=True)
        events = self._timing_events()
        verify = self.replay_verify(rows, events)
        _record_event(events, 1)
        verify.accept.graph.replay()
        verify.draft.graph.replay()
        self.num_draft_replays += 1
        _record_event(events, 2)
        result = verify.accept.result[:num_seqs]
        packed = torch.cat([result.view(-1), verify.draft.ids[: num_seqs * rows_per_seq]])
        host = self._read_back(packed, blocking).tolist()
        width = rows_per_seq + 1
        targets = [host[b * width: b * width + rows_per_seq] for b in range(num_seqs)]
        accepted = [host[b * width + rows_per_seq] for b in range(num_seqs)]
        ids = host[num_seqs * width:]
        drafted = [ids[b * rows_per_seq + a] for b, a in enumerate(accepted)]
        return GreedyStep(targets, accepted, drafted, verify.draft, rows_per_seq)

    def _timing_events(self) -> tuple[torch.cuda.Event, ...] | None:
        if self.replay_events is None:
            return None
        events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        self.replay_events.append(events)
        return events

    def _read_back(self, values: torch.Tensor, blocking: bool) -> torch.Tensor:
        if values.device.type != "cuda":
            return values
        if self._result_host is None or self._result_host.numel() < values.numel():
            self._result_host = torch.empty(values.numel() * 2, dtype=values.dtype,
                                            pin_memory=True)
        host = self._result_host[: values.numel()]
        host.copy_(values, non_blocking=True)
        done = torch.cuda.Event(blocking=blocking)
        done.record()
        done.synchronize()
        return host

    def padding_sequence(self) -> VerifyHostRows:
        """One sequence of k + 1 rows that touch only the reserved slot and page (position j
        of the reserved slot lies in the reserved page, as every page of its page-table row)."""
        runner, rows = self.runner, self.rows_per_seq
        first, page = runner.dummy_page * runner.page_size, runner.page_size
        return VerifyHostRows([0] * rows, [first + j % page for j in range(rows)],
                              list(range(rows)), [runner.dummy_slot] * rows,
                              [1] + [0] * (rows - 1), [rows], 0)

    def _padded(self, rows: VerifyHostRows, size: int) -> VerifyHostRows:
        """`rows` in a graph's shape: each sequence's rows then padding rows up to k + 1, then
        padding sequences up to `size`. A sequence's first padding row starts the reserved
        slot's state afresh."""
        pad, full = self.padding_sequence(), self.rows_per_seq
        fields: list[list[int]] = [[] for _ in range(5)]
        first = 0
        for count in rows.num_tokens:
            for out, values, padding in zip(fields, rows[:5], pad[:5], strict=True):
                out += values[first: first + count] + padding[count:]
            if count < full:
                fields[4][len(fields[4]) - full + count] = 1
            first += count
        missing = size - len(rows.num_tokens)
        fields = [out + padding * missing for out, padding in zip(fields, pad[:5], strict=True)]
        return VerifyHostRows(*fields, [full] * size, rows.num_pools)

    def _handoff(self) -> GraphHandOff | None:
        graphs = self.runner.graphs
        return graphs.handoff if graphs is not None else None

    def _capture_verify(self, size: int, width: int, pool) -> CapturedVerify:
        packed = pack_verify(self._padded(self._empty(), size), save=True)
        return spec_capture.capture_verify(self.spec, packed, size, width, self.rows_per_seq,
                                           pool)

    @staticmethod
    def _empty() -> VerifyHostRows:
        return VerifyHostRows([], [], [], [], [], [], 0)


def _record_event(events: tuple[torch.cuda.Event, ...] | None, index: int) -> None:
    if events is not None:
        events[index].record()
