"""Training steps of one fixed batch shape replayed as one CUDA graph: the forward, the
backward, gradient clipping, the optimizer step and the routers' balancing.

The eager step launches thousands of small kernels from Python (the reference ops under
autograd), so on a GPU the tiny model trains at the host's pace. When every batch has one shape
(tiny_batches.FixedShape), the integer structure of a step (sequence offsets, loss rows, page
tables, the padded layouts of the batched ops) is the same at every step; only the token ids,
loss weights, padding masks, pixels and the pictures' token rows change. Those live in device
buffers made once (`StepTensors`) and refilled before each replay. The structure's own uploads
are made by the warm-up steps and reused by the capture (`UploadMemo`), which refuses any new
one.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch

from glmflash.config import ModelConfig
from glmflash.utils.device import UploadMemo, remembered_uploads
from glmflash.utils.graph_capture import isolated_capture
from tools.tiny_batches import HostBatch
from tools.tiny_trainer import StepTensors, step_tensors

logger = logging.getLogger("glmflash.train_tiny")
# Eager steps before a capture (lazy initialisations, the uploads' memo).
WARMUP_STEPS = 3


class GraphStep:
    """Runs `body` (one whole training step over `self.inputs`, returning its losses) on fixed
    input buffers: `WARMUP_STEPS` eager steps, then as a CUDA graph. `recapture()` starts over
    (the forward changed, e.g. fake FP8 weights).

    `body` sets the gradients to None before its backward: in the capture, the backward then
    writes them into buffers of the graph's pool, which every replay overwrites (no
    accumulation across steps)."""

    def __init__(self, body: Callable[[StepTensors], torch.Tensor], first: HostBatch,
                 device: torch.device, config: ModelConfig) -> None:
        self.body, self.device, self.config = body, device, config
        self.inputs = step_tensors(first, device, config)
        self.memo = UploadMemo()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.losses: torch.Tensor | None = None
        self.warm = 0

    def __call__(self, host: HostBatch) -> torch.Tensor:
        """Train on `host` (of the first batch's shape); returns a copy of its losses. On a
        CPU the steps after the warm-up run eagerly under the frozen memo: what a capture
        could replay."""
        refill(self.inputs, step_tensors(host, self.device, self.config))
        if self.warm < WARMUP_STEPS:
            self.warm += 1
            return self._warm_step()
        if self.device.type != "cuda":
            with self._frozen():
                return self.body(self.inputs).clone()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.losses.clone()

    def recapture(self) -> None:
        self.graph, self.losses, self.warm = None, None, 0

    def _warm_step(self) -> torch.Tensor:
        if self.device.type != "cuda":
            with remembered_uploads(self.memo):
                return self.body(self.inputs).clone()
        # On a side stream, as CUDA graph warm-ups must be.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), remembered_uploads(self.memo):
            losses = self.body(self.inputs).clone()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return losses

    @contextlib.contextmanager
    def _frozen(self):
        self.memo.frozen = True
        try:
            with remembered_uploads(self.memo):
                yield
        finally:
            self.memo.frozen = False

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        with self._frozen(), isolated_capture(graph):
            self.losses = self.body(self.inputs)
        self.graph = graph
        logger.info("captured the training step as a CUDA graph (%d uploads reused)",
                    len(self.memo.tensors))


def refill(inputs: StepTensors, fresh: StepTensors) -> None:
    """Copy the per-batch values of `fresh` into the fixed buffers `inputs` (same shape)."""
    if inputs.batch.cu_seqlens != fresh.batch.cu_seqlens:
        raise ValueError("a graph-captured run needs every batch in one shape")
    pairs = [(inputs.batch.input_ids, fresh.batch.input_ids),
             (inputs.mtp_batch.input_ids, fresh.mtp_batch.input_ids),
             (inputs.weight, fresh.weight), (inputs.counted, fresh.counted),
             (inputs.mtp_counted, fresh.mtp_counted),
             (inputs.pixel_values, fresh.pixel_values), (inputs.picture_rows, fresh.picture_rows)]
    for target, source in pairs:
        if (target is None) != (source is None):
            raise ValueError("a graph-captured run needs room for pictures in every batch")
        if target is not None:
            target.copy_(source)
    inputs.num_trained = fresh.num_trained
