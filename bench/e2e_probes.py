"""Instruments of bench/e2e.py: per-layer clocks and routing capture, one profiled step, the CPU
expert timer, bandwidth probes, and the bytes a decode step must read (the roofline)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.autograd import DeviceType

from glmflash.config import MLA, ModelConfig
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Experts, MoE

LAYER_RANGE = "e2e.layer"
_NOT_KERNELS = ("Memcpy", "Memset")


class TimedKernel:
    """A CPU expert kernel that adds the seconds spent in `forward` to `clock.seconds`."""

    def __init__(self, kernel, clock: CpuExpertClock) -> None:
        self.kernel, self.clock = kernel, clock

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.kernel.forward(*args, **kwargs)
        finally:
            self.clock.seconds += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)


class CpuExpertClock:
    """Seconds the CPU expert kernels of all MoE layers ran (on the expert worker thread)."""

    def __init__(self, model: GlmForCausalLM) -> None:
        self.seconds = 0.0
        self.modules = [m for m in model.modules()
                        if isinstance(m, Experts) and m.cpu_kernel is not None]
        for m in self.modules:
            m.cpu_kernel = TimedKernel(m.cpu_kernel, self)

    def close(self) -> None:
        for m in self.modules:
            m.cpu_kernel = m.cpu_kernel.kernel


class LayerProbe:
    """Hooks on every decoder layer and router while open.

    `ranges=False`: marks each layer's start and end (CUDA events on a GPU, so the host is never
    synchronised; perf_counter on the CPU) and keeps every router's expert ids.
    `ranges=True`: wraps each layer in a profiler range named LAYER_RANGE + index.
    """

    def __init__(self, model: GlmForCausalLM, *, ranges: bool = False) -> None:
        self.model, self.ranges = model, ranges
        self.is_cuda = model.text.embed_tokens.weight.is_cuda
        self.marks: list[tuple[int, object, object]] = []
        self.routes: list[tuple[int, torch.Tensor]] = []
        self._open: dict[int, object] = {}
        self._handles: list = []

    def __enter__(self) -> LayerProbe:
        for i, layer in enumerate(self.model.text.layers):
            self._handles.append(layer.register_forward_pre_hook(self._opener(i)))
            self._handles.append(layer.register_forward_hook(self._closer(i)))
        if not self.ranges:
            for j, moe in enumerate(moe_layers(self.model)):
                self._handles.append(moe.gate.register_forward_hook(self._router(j)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _mark(self):
        if not self.is_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _opener(self, i: int):
        def hook(module, args):
            if self.ranges:
                self._open[i] = torch.profiler.record_function(f"{LAYER_RANGE}{i}").__enter__()
            else:
                self._open[i] = self._mark()
        return hook

    def _closer(self, i: int):
        def hook(module, args, output):
            opened = self._open.pop(i)
            if self.ranges:
                opened.__exit__(None, None, None)
            else:
                self.marks.append((i, opened, self._mark()))
        return hook

    def _router(self, j: int):
        def hook(module, args, output):
            self.routes.append((j, output[0]))
        return hook

    def layer_ms(self) -> list[float]:
        """Mean milliseconds of each layer over the marked forwards."""
        if self.is_cuda:
            torch.cuda.synchronize()
        total = [0.0] * len(self.model.text.layers)
        count = [0] * len(total)
        for i, start, end in self.marks:
            total[i] += start.elapsed_time(end) if self.is_cuda else 1e3 * (end - start)
            count[i] += 1
        return [t / max(c, 1) for t, c in zip(total, count, strict=True)]

    def expert_hits(self) -> list[tuple[float, float]]:
        """Per MoE layer, mean distinct experts hit per forward: (on the model device, on CPU)."""
        moes = moe_layers(self.model)
        sums = [[0.0, 0.0] for _ in moes]
        for j, ids in self.routes:
            hit = ids.unique()
            on_device = int(resident_mask(moes[j].experts, self.is_cuda)[hit].sum())
            sums[j][0] += on_device
            sums[j][1] += hit.numel() - on_device
        num_forwards = max(1, len(self.routes) // max(1, len(moes)))
        return [(d / num_forwards, c / num_forwards) for d, c in sums]


def moe_layers(model: GlmForCausalLM) -> list[MoE]:
    return [layer.mlp for layer in model.text.layers if isinstance(layer.mlp, MoE)]


def resident_mask(experts: Experts, is_cuda: bool) -> torch.Tensor:
    """`[E]` bool: experts computed where the model lives (hybrid: the resident ones; the rest
    run on the CPU kernel)."""
    local = getattr(experts.backend, "local", None)
    if local is not None:
        return local >= 0
    num_experts = experts.gate_proj.weight.shape[0]
    return torch.ones(num_experts, dtype=torch.bool, device="cuda" if is_cuda else "cpu")


@dataclass
class StepProfile:
    kernels_per_layer: list[int] | None
    """CUDA kernels launched inside each layer (None: the profiler did not attribute them)."""
    num_kernels: int
    gpu_busy_ms: float
    """Kernels, copies and memsets summed over the step (GPU only)."""


def profile_step(engine) -> StepProfile:
    """One `engine.step()` under torch.profiler with a range per layer."""
    model = engine.runner.model
    is_cuda = model.text.embed_tokens.weight.is_cuda
    activities = [torch.profiler.ProfilerActivity.CPU]
    if is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        with LayerProbe(model, ranges=True):
            engine.step()
        if is_cuda:
            torch.cuda.synchronize()
    events = prof.events()
    # NOTE: the profiler mirrors each range on the GPU timeline under the same name: not a kernel.
    device = [e for e in events if e.device_type == DeviceType.CUDA and
              not getattr(e, "is_user_annotation", False) and not e.name.startswith(LAYER_RANGE)]
    kernels = [e for e in device if not e.name.startswith(_NOT_KERNELS)]
    per_layer = [0] * len(model.text.layers)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith(LAYER_RANGE):
            per_layer[int(e.name[len(LAYER_RANGE):])] += _subtree_kernels(e)
    busy_us = sum(e.time_range.end - e.time_range.start for e in device)
    attributed = per_layer if sum(per_layer) or not kernels else None
    return StepProfile(attributed, len(kernels), busy_us / 1e3)


def _subtree_kernels(root) -> int:
    count, stack = 0, [root]
    while stack:
        event = stack.pop()
        count += sum(1 for k in event.kernels if not k.name.startswith(_NOT_KERNELS))
        stack.extend(event.cpu_children)
    return count


def cpu_read_gbs(num_bytes: int) -> float:
    """The read probe of bench/cpu_moe.py: a parallel sum over `num_bytes` of fp32 (all cores)."""
    from bench.cpu_moe import PROBE_CHUNKS, _read_sum_nb, median_time

    probe = np.ones(num_bytes // 4, np.float32)
    partial = np.zeros(PROBE_CHUNKS, np.float32)
    return probe.nbytes / median_time(lambda: _read_sum_nb(probe, partial), 5) / 1e9


@dataclass
class StepBytes:
    device: float
    """Read from the model device's memory: non-expert weights, the batch's embedding rows, the
    experts hit there, and KV/state (the KDA state counted read and written)."""
    cpu: float
    """Read by the CPU expert kernel: the FP8 weights and scales of the CPU experts hit."""


def step_bytes(model: GlmForCausalLM, batch: int, context: int,
               hits: list[tuple[float, float]]) -> StepBytes:
    """Bytes one decode step of `batch` sequences at `context` tokens must move."""
    expert_ids = {id(p) for m in model.modules() if isinstance(m, Experts)
                  for p in m.parameters()}
    embed = model.text.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters()
                  if id(p) not in expert_ids and p is not embed)
    weights += batch * embed.shape[1] * embed.element_size()
    per_expert = expert_bytes(moe_layers(model)[0].experts) if hits else 0
    cache = batch * cache_bytes_per_sequence(model.config, context, embed.element_size())
    return StepBytes(weights + cache + per_expert * sum(d for d, _ in hits),
                     per_expert * sum(c for _, c in hits))


def expert_bytes(experts: Experts) -> int:
    """One routed expert: gate, up and down weights plus their block scales."""
    total = 0
    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        for t in (proj.weight, getattr(proj, "weight_scale_inv", None)):
            if t is not None:
                total += t[0].numel() * t.element_size()
    return total


def cache_bytes_per_sequence(config: ModelConfig, context: int, itemsize: int) -> int:
    """KV/state bytes one sequence's decode step moves at `context` tokens."""
    total = 0
    for i, kind in enumerate(config.layer_types):
        if kind == MLA:
            if config.indexer_types[i] == "full":
                # The indexer scores every pooled key of the context.
                total += -(-context // config.index_kpool) * config.index_head_dim * itemsize
            selected = min(context, config.index_topk + config.index_kpool - 1)
            total += selected * config.kv_lora_rank * itemsize
        else:
            d, taps = config.linear_head_dim, config.linear_conv_kernel_dim - 1
            total += 2 * config.linear_num_heads * d * d * 4
            total += 2 * 3 * config.linear_dim * taps * itemsize
    return total
