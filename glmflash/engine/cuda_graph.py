"""Decode steps replayed from CUDA graphs.

One graph per (batch size, selection width), captured at start-up after the cache is planned and
the kernels are warm, into one memory pool, largest first. A decode forward reads its batch only
from device tensors (model/forward_batch.py `DecodeRows`), so a graph replays any batch of its
size once the batch's values are copied into its input buffer. The selection width (pools the
indexer scores per sequence) is the one host value a decode forward depends on: widths grow by
4x up to the cache's longest sequence, and a batch takes the narrowest that holds its longest
sequence. A batch of n decodes replays the smallest captured size >= n; rows n.. are padding:
the runner's reserved state slot and page, position 0, fresh state, no CPU experts. Steps with
prefill tokens, more decodes than the largest size, or prompt rows run eagerly.

Hybrid CPU experts run inside the graphs through host nodes (engine/graph_handoff.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmflash.engine.experts import hybrid_layers, placement_graph_handoff
from glmflash.model.forward_batch import decode_batch
from glmflash.utils.device import upload
from glmflash.utils.env import kernel_override
from glmflash.utils.graph_capture import record

if TYPE_CHECKING:
    from glmflash.engine.graph_handoff import GraphHandOff
    from glmflash.engine.model_runner import DecodeHostRows, ModelRunner
    from glmflash.engine.options import EngineConfig

logger = logging.getLogger(__name__)
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# Ops whose reference implementation reads device values on the host (not capturable).
_CAPTURED_OPS = ("kda", "causal_conv1d", "indexer", "indexer_select", "sparse_mla", "fused_moe",
                 "cpu_moe")


@dataclass
class CapturedDecode:
    graph: torch.cuda.CUDAGraph
    packed: torch.Tensor
    """The inputs, as `pack_decode` lays them out; a replay reads them."""
    staging: torch.Tensor
    """Page-locked host copy of `packed`, rewritten per replay: the previous replay's copy out
    of it is done, since the engine waits for each step's sampled ids."""
    logits: torch.Tensor
    """The output `[B, V]`; a replay overwrites it."""
    hidden: torch.Tensor
    """The main model's hidden state of every row `[B, D]` (what the MTP layer reads while
    speculative decoding holds drafting off); a replay overwrites it."""


def graph_batch_sizes(requested: tuple[int, ...] | None, max_batch_size: int | None,
                      max_running_requests: int, layerwise_threshold: int | None
                      ) -> list[int]:
    """The sizes to capture: the requested ones (default 1..32), capped by `max_batch_size`
    and `max_running_requests`, and below the layerwise prefill threshold (a batch that large
    takes the layerwise expert path eagerly)."""
    limit = min(max_batch_size or max_running_requests, max_running_requests)
    if layerwise_threshold is not None:
        limit = min(limit, layerwise_threshold - 1)
    return sorted({b for b in (requested or DEFAULT_BATCH_SIZES) if b <= limit})


def decode_graph_sizes(options: EngineConfig, device: torch.device) -> list[int]:
    """The decode batch sizes an engine with these options captures on `device` (none when
    graphs are off or impossible there)."""
    if options.disable_cuda_graph or graphs_unsupported(device) is not None:
        return []
    return graph_batch_sizes(options.cuda_graph_bs, options.cuda_graph_max_bs,
                             options.max_running_requests,
                             options.kt_gpu_prefill_token_threshold)


def spec_graph_sizes(options: EngineConfig, device: torch.device) -> list[int]:
    """The batch sizes whose verify and draft forwards are captured (speculative decoding):
    the decode sizes up to the largest batch that drafts."""
    if not options.num_speculative_steps:
        return []
    rows = 1 + options.num_speculative_steps
    threshold = options.kt_gpu_prefill_token_threshold
    # A verify of as many rows as the layerwise threshold would take the layerwise expert path.
    return [b for b in decode_graph_sizes(options, device)
            if b <= options.speculative_max_batch_size
            and (threshold is None or b * rows < threshold)]


def max_graph_rows(options: EngineConfig, device: torch.device) -> int:
    """The most token rows of any captured forward: a decode batch, or a verify batch of
    drafts + 1 rows per sequence (0 without graphs)."""
    rows = 1 + options.num_speculative_steps
    return max([*decode_graph_sizes(options, device),
                *(b * rows for b in spec_graph_sizes(options, device))], default=0)


def graphs_unsupported(device: torch.device) -> str | None:
    """Why decode graphs cannot be captured here, or None."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    forced = [op for op in _CAPTURED_OPS if kernel_override(op) == "ref"]
    if forced:
        return f"the reference kernels forced for {forced} read device values on the host"
    return None


class CudaGraphRunner:
    """Owns the captured decode graphs of one ModelRunner and their input buffers."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int]) -> None:
        self.runner = runner
        self.batch_sizes = sorted(batch_sizes)
        self.graphs: dict[tuple[int, int], CapturedDecode] = {}
        self.handoff: GraphHandOff | None = None
        self.pool = None
        """The graphs' memory pool, once captured (speculative decoding's graphs share it)."""
        self.num_replays = 0
        self.replay_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        """Benchmarks: a list to collect (start, end) CUDA events around each replay."""

    def can_replay(self, num_rows: int) -> bool:
        return bool(self.graphs) and num_rows <= self.batch_sizes[-1]

    def capture(self) -> None:
        device = self.runner.device
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        self._attach_handoff()
        pool = None
        for width in reversed(self.runner.pool_widths):
            for size in reversed(self.batch_sizes):
                captured = self._capture(size, width, pool)
                pool = captured.graph.pool()
                self.graphs[(size, width)] = captured
        self.pool = pool
        torch.cuda.synchronize(device)
        used = (free_before - torch.cuda.mem_get_info(device)[0]) / 2**20
        logger.info("CUDA graphs: decode of %s sequences x selection widths %s pools, %d graphs "
                    "captured in %.1f s, %.0f MiB%s", self.batch_sizes, self.runner.pool_widths,
                    len(self.graphs), time.perf_counter() - start, used,
                    "; CPU experts inside them" if self.handoff else "")

    def replay_captured(self, rows: DecodeHostRows) -> CapturedDecode:
        """Replay the graph that holds n decodes: rows 0..n-1 of its outputs are theirs."""
        num_rows = len(rows.input_ids)
        size = next(b for b in self.batch_sizes if b >= num_rows)
        captured = self.graphs[(size, self.runner.pool_width(rows.num_pools))]
        captured.staging.numpy()[:] = self.runner.pack_decode(rows, pad_to=size)
        captured.packed.copy_(captured.staging, non_blocking=True)
        if self.handoff is not None:
            self.handoff.set_live_rows(num_rows)
        events = self._timing_events()
        captured.graph.replay()
        if events is not None:
            events[1].record()
        if self.handoff is not None:
            self.handoff.check()
        self.num_replays += 1
        return captured

    def _timing_events(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if self.replay_events is None:
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        self.replay_events.append(events)
        return events

    def close(self) -> None:
        # The hand-off belongs to the expert placement (engine/experts.py `close_placement`).
        self.handoff = None

    def _attach_handoff(self) -> None:
        """The placement's graph hand-off, when CPU experts run inside the graphs."""
        model = self.runner.model
        if all(layer.num_gpu == layer.num_experts for layer in hybrid_layers(model)):
            return
        self.handoff = placement_graph_handoff(model)
        if self.handoff is None or self.handoff.max_rows < self.batch_sizes[-1]:
            raise RuntimeError(f"the expert placement made no graph hand-off for decode batches "
                               f"of {self.batch_sizes[-1]}: place the experts with graph_rows")

    def _capture(self, size: int, width: int, pool) -> CapturedDecode:
        runner = self.runner
        packed = upload(runner.pack_decode(runner.padding_rows(size)), runner.device)

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            # A new ForwardBatch per forward: its memo must not carry values across them.
            batch = decode_batch(packed, runner.page_table, runner.page_size, width)
            hidden = runner.model.hidden_states(batch, runner.state)
            return runner.model.logits(hidden[batch.logits_index]), hidden

        graph, (logits, hidden) = record(forward, pool, runner.device)
        return CapturedDecode(graph, packed, torch.empty_like(packed, device="cpu").pin_memory(),
                              logits, hidden)
