"""Where routed experts live: CPU (numba kernel) plus a GPU-resident subset, and layerwise prefill.

A model transform: `plan_placement` decides which experts are resident (once, before anything is
copied), `place_experts` gives each `Experts` module a `HybridExperts` backend built with
everything it needs; `MoE.forward` starts it before the shared expert and finishes it after.
Hybrid decode: as soon as a layer's routing is known its CPU experts are handed off (copies on a
side stream, then a worker thread; engine/expert_handoff.py has the order) and run while the GPU
runs the resident experts (the grouped kernel, with the CPU experts' ids set to -1) and the
shared expert; the CPU result is added on the GPU. Nothing in it reads the GPU from the host.
Layerwise prefill (engine/layerwise.py): a chunk of at least `prefill_token_threshold` tokens runs
every expert of the layer on the GPU from a full-layer slot.
"""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from glmflash.engine.expert_handoff import CpuHandOff, ExpertTimes
from glmflash.engine.layerwise import DeviceWeights, LayerwiseStreamer
from glmflash.engine.options import EngineConfig
from glmflash.model.forward_batch import build_forward_batch, contiguous_page_table
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Experts, Router, grouped_experts
from glmflash.model.state import ModelState

if TYPE_CHECKING:
    from glmflash.engine.graph_handoff import GraphHandOff

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertPlacement:
    num_gpu_experts: int = 0
    """Experts per layer resident on the GPU."""
    resident_ids: tuple[tuple[int, ...], ...] | None = None
    """Which experts, per MoE layer (e.g. the most frequently routed); None: the first N."""
    prefill_token_threshold: int | None = None
    """Chunks of at least this many tokens take the layerwise path (None: never)."""
    pin_host_memory: bool = True
    """Page-lock the CPU expert weights in place so host-to-device copies run at DMA speed."""
    graph_rows: int = 0
    """Rows of the largest captured decode graph (0: no graphs). The CPU experts of captured
    decodes go through one graph hand-off (engine/graph_handoff.py) sized for them."""


@dataclass(slots=True)
class PendingExperts:
    """A layer's routed experts between `HybridExperts.start` and `finish`."""

    gpu_out: torch.Tensor | None
    """The GPU experts' sum (resident or layerwise), queued on the main stream."""
    cpu_job: Future | None = None
    """The CPU experts' job; its output waits in the hand-off's pinned buffer."""
    cpu_inputs: tuple[torch.Tensor, ...] = ()
    """x and the CPU part's ids and weights: the side stream reads them until the job starts."""
    gpu_begin: torch.cuda.Event | None = None
    """Timing on: recorded on the main stream after routing."""
    captured: bool = False
    """The CPU part went through the graph hand-off (a captured decode)."""


class HybridExperts:
    """A MoE layer's routed experts split between resident GPU experts and the CPU kernel."""

    def __init__(self, module: Experts, index: int, placement: ExpertPlacement,
                 device: torch.device, streamer: LayerwiseStreamer | None,
                 resident: tuple | None, resident_ids: list[int], handoff: CpuHandOff,
                 graph_handoff: GraphHandOff | None = None) -> None:
        self.module, self.index, self.device = module, index, device
        self.num_gpu = len(resident_ids)
        self.num_experts = module.gate_proj.weight.shape[0]
        self.threshold = placement.prefill_token_threshold
        self.streamer, self.resident, self.handoff = streamer, resident, handoff
        # Expert id -> row in the resident weights, or -1 for a CPU expert.
        self.local = torch.full((self.num_experts,), -1, dtype=torch.long, device=device)
        self.local[torch.tensor(resident_ids, dtype=torch.long, device=device)] = \
            torch.arange(self.num_gpu, device=device)
        self.graph_handoff = graph_handoff
        """The hand-off of captured decodes (shared by the layers; None without graphs)."""
        self.times = ExpertTimes()
        """Summed since the last `take_times()`."""
        self.record_gpu_times = False
        """Benchmarks: measure GPU time with CUDA events (read by `take_times`)."""
        self._gpu_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.finish(self.start(x, ids, weights))

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> PendingExperts:
        """Hand the CPU experts off, then queue the resident ones (or the layerwise slot)."""
        if self.graph_handoff is not None and torch.cuda.is_current_stream_capturing():
            return self._start_captured(x, ids, weights)
        if self.streamer is not None and x.shape[0] >= self.threshold:
            slot = self.streamer.acquire(self.index)
            return PendingExperts(grouped_experts(x, ids, weights, slot, self.module.limit))
        pending = PendingExperts(None, gpu_begin=self._event())
        local = self.local[ids]
        if self.num_gpu < self.num_experts:
            pending.cpu_inputs = (x, torch.where(local < 0, ids, -1), weights.float())
            pending.cpu_job = self.handoff.submit(self.module.cpu_experts(), *pending.cpu_inputs)
        if self.num_gpu:
            pending.gpu_out = grouped_experts(x, local, weights, self.resident, self.module.limit)
        return pending

    def _start_captured(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                        ) -> PendingExperts:
        """Inside a graph capture: the CPU part goes through the graph hand-off."""
        local = self.local[ids]
        pending = PendingExperts(None)
        if self.num_gpu < self.num_experts:
            self.graph_handoff.start(self.index, x, torch.where(local < 0, ids, -1),
                                     weights.float())
            pending.cpu_inputs, pending.captured = (x,), True
        if self.num_gpu:
            pending.gpu_out = grouped_experts(x, local, weights, self.resident, self.module.limit)
        return pending

    def finish(self, pending: PendingExperts) -> torch.Tensor:
        """Wait for the CPU experts (a host wait) and add their result on the GPU."""
        if pending.captured:
            x = pending.cpu_inputs[0]
            cpu = self.graph_handoff.finish(x.shape[0], x.dtype)
            return cpu if pending.gpu_out is None else pending.gpu_out + cpu
        if pending.cpu_job is None:
            return pending.gpu_out
        if pending.gpu_begin is not None:
            self._gpu_events.append((pending.gpu_begin, self._event()))
        begin = time.perf_counter()
        cpu_s = pending.cpu_job.result()
        self.times.wait_s += time.perf_counter() - begin
        self.times.cpu_s += cpu_s
        self.times.num_calls += 1
        x = pending.cpu_inputs[0]
        cpu = self.handoff.output(x.shape[0]).to(x.dtype)
        return cpu if pending.gpu_out is None else pending.gpu_out + cpu

    def take_times(self) -> ExpertTimes:
        """The times since the last call. Waits for the recorded GPU events: benchmarks only."""
        times, self.times = self.times, ExpertTimes()
        for begin, end in self._gpu_events:
            end.synchronize()
            times.gpu_s += begin.elapsed_time(end) / 1e3
        self._gpu_events.clear()
        return times

    def _event(self) -> torch.cuda.Event | None:
        if not self.record_gpu_times:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event


def hybrid_layers(model: nn.Module) -> list[HybridExperts]:
    return [m.backend for m in model.modules()
            if isinstance(m, Experts) and isinstance(m.backend, HybridExperts)]


def take_expert_times(model: nn.Module) -> ExpertTimes:
    """All hybrid layers' times since the last call, summed (see `HybridExperts.take_times`)."""
    total = ExpertTimes()
    for layer in hybrid_layers(model):
        total.add(layer.take_times())
    return total


def plan_placement(model: nn.Module, options: EngineConfig, device: torch.device,
                   warmup_ids: list[int] | None = None) -> ExpertPlacement:
    """The engine options' placement, decided before anything is copied to the GPU: the first
    N experts of each layer, or (`kt_expert_placement="frequency"`) the N most routed over the
    warm-up prompt `warmup_ids`."""
    from glmflash.engine.cuda_graph import max_graph_rows

    placement = ExpertPlacement(options.kt_num_gpu_experts or 0,
                                prefill_token_threshold=options.kt_gpu_prefill_token_threshold,
                                graph_rows=max_graph_rows(options, device))
    if options.kt_expert_placement != "frequency" or not warmup_ids:
        return placement
    chosen = most_routed(count_routing(model, device, warmup_ids), placement.num_gpu_experts)
    logger.info("resident experts chosen by routing frequency over %d warm-up tokens",
                len(warmup_ids))
    return replace(placement, resident_ids=chosen)


def place_experts(model: nn.Module, placement: ExpertPlacement, device: torch.device) -> None:
    """The placement transform: every MoE layer of a model whose experts stayed on the CPU
    gets its HybridExperts (resident copies, layerwise slots and the hand-off made here)."""
    modules = _experts(model)
    if not modules:
        return
    num_experts = modules[0].gate_proj.weight.shape[0]
    if not 0 <= placement.num_gpu_experts <= num_experts:
        raise ValueError(f"kt_num_gpu_experts must be in [0, {num_experts}]")
    top_k = next(m for m in model.modules() if isinstance(m, Router)).top_k
    streamer = _attach(modules, placement, device, top_k)
    logger.info("experts: %d of %d per layer on the GPU, the rest on the CPU; layerwise prefill %s",
                placement.num_gpu_experts, num_experts,
                f"from {placement.prefill_token_threshold} tokens"
                if streamer is not None else "off")


def _experts(model: nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


def _attach(modules: list[Experts], placement: ExpertPlacement, device: torch.device,
            top_k: int = 0) -> LayerwiseStreamer | None:
    resident_ids = [list(ids) for ids in placement.resident_ids] if placement.resident_ids \
        else [list(range(placement.num_gpu_experts))] * len(modules)
    assert len(resident_ids) == len(modules)
    resident = [_resident(m, ids, device) for m, ids in zip(modules, resident_ids, strict=True)]
    if placement.pin_host_memory and placement.prefill_token_threshold is not None:
        for m in modules:
            _pin(m)
    streamer = LayerwiseStreamer(modules, resident, resident_ids, device) \
        if placement.prefill_token_threshold is not None else None
    handoff = CpuHandOff(device)
    graph_handoff = _graph_handoff(modules, resident_ids, top_k, placement, device)
    for i, m in enumerate(modules):
        m.backend = HybridExperts(m, i, placement, device, streamer, resident[i],
                                  resident_ids[i], handoff, graph_handoff)
    return streamer


def _graph_handoff(modules: list[Experts], resident_ids: list[list[int]], top_k: int,
                   placement: ExpertPlacement, device: torch.device) -> GraphHandOff | None:
    """The hand-off of the CPU experts inside decode graphs, when some experts stay on the CPU
    and graphs will be captured."""
    num_experts = modules[0].gate_proj.weight.shape[0]
    if not placement.graph_rows or all(len(ids) == num_experts for ids in resident_ids):
        return None
    from glmflash.engine.graph_handoff import GraphHandOff
    from glmflash.kernels.cpu_moe import NumbaMoeExperts

    kernels = [m.cpu_experts() for m in modules]
    if not all(isinstance(k, NumbaMoeExperts) for k in kernels):
        raise RuntimeError("CPU experts in CUDA graphs need the Numba kernel")
    return GraphHandOff(kernels, placement.graph_rows, top_k, device)


def placement_graph_handoff(model: nn.Module) -> GraphHandOff | None:
    """The graph hand-off the placement made (one, shared by every hybrid layer), or None."""
    return next((layer.graph_handoff for layer in hybrid_layers(model)
                 if layer.graph_handoff is not None), None)


def close_placement(model: nn.Module) -> None:
    """Stop what the placement started: the graph hand-off's serving loop."""
    handoff = placement_graph_handoff(model)
    if handoff is not None:
        handoff.close()
        for layer in hybrid_layers(model):
            layer.graph_handoff = None


def _resident(module: Experts, ids: list[int], device: torch.device) -> tuple | None:
    if not ids:
        return None
    weights = tuple(DeviceWeights(p, len(ids), device) for p in module.projections())
    for dst, src in zip(weights, module.projections(), strict=True):
        dst.gather(src, ids)
    return weights


@torch.inference_mode()
def count_routing(model: GlmForCausalLM, device: torch.device,
                  warmup_ids: list[int]) -> list[torch.Tensor]:
    """Per MoE layer, how often each expert is chosen over one warm-up prompt `[E]`. The routed
    experts run on the CPU meanwhile (a temporary all-CPU backend: nothing is copied to the
    GPU for the count); the model's backends are restored afterwards."""
    routers = [m for m in model.modules() if isinstance(m, Router)]
    modules = _experts(model)
    backends = [m.backend for m in modules]
    _attach(modules, ExpertPlacement(0), device)
    for router in routers:
        router.counts = torch.zeros(router.weight.shape[0], dtype=torch.long, device=device)
    try:
        n = len(warmup_ids)
        kpool = model.config.index_kpool
        size = -(-n // kpool) * kpool
        state = ModelState(model.config, num_token_slots=size, num_state_slots=1,
                           dtype=model.dtype, device=device)
        pages = contiguous_page_table(1, size, size, device)
        model(build_forward_batch(warmup_ids, np.arange(n), [0, n], [0], [0], pages, size),
              state)
        return [router.counts.cpu() for router in routers]
    finally:
        for router in routers:
            router.counts = None
        for m, backend in zip(modules, backends, strict=True):
            m.backend = backend


def most_routed(counts: list[torch.Tensor], num_gpu: int) -> tuple[tuple[int, ...], ...]:
    """Per layer, the `num_gpu` experts chosen most often (ties: lower id first)."""
    return tuple(tuple(sorted(torch.argsort(c, descending=True, stable=True)[:num_gpu].tolist()))
                 for c in counts)


_REGISTERED: set[int] = set()


def _pin(module: Experts) -> None:
    """Page-lock the expert tensors where they are (no copy), once per allocation.

    NOTE: the registration is dropped when the parameter dies; a registration left on freed
    memory makes later copies from a reused address fail with "invalid argument".
    """
    cudart = torch.cuda.cudart()
    for p in module.projections():
        for param in (p.weight, getattr(p, "weight_scale_inv", None)):
            if param is None or param.data_ptr() in _REGISTERED or param.is_pinned():
                continue
            ptr = param.data_ptr()
            cudart.cudaHostRegister(ptr, param.numel() * param.element_size(), 0)
            _REGISTERED.add(ptr)
            weakref.finalize(param, _unregister, ptr)


def _unregister(ptr: int) -> None:
    if ptr in _REGISTERED:
        _REGISTERED.discard(ptr)
        torch.cuda.cudart().cudaHostUnregister(ptr)
