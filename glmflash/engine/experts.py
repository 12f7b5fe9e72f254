"""Where routed experts live: CPU (numba kernel) plus a GPU-resident subset, and layerwise prefill.

Hybrid decode: a layer's CPU experts run on a worker thread (the numba kernel releases the GIL)
while the GPU runs the shared expert and the resident experts; the CPU result is added on the GPU.
Layerwise prefill: a chunk of at least `prefill_token_threshold` tokens runs every expert of the
layer on the GPU from a full-layer slot; the next MoE layer's experts are copied into the other
slot on a side stream while this layer computes (two slots). Resident experts are copied into the
slot device-to-device, the others host-to-device.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from glmflash.kernels.fp8_gemm import dequantize_block_fp8
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Experts, StackedWeight, experts_loop

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertPlacement:
    num_gpu_experts: int = 0
    """Experts per layer resident on the GPU (the first N)."""
    prefill_token_threshold: int | None = None
    """Chunks of at least this many tokens take the layerwise path (None: never)."""
    pin_host_memory: bool = True
    """Page-lock the CPU expert weights in place so host-to-device copies run at DMA speed."""


class DeviceWeights:
    """Some experts' weights of one projection on a device, with `expert(e, dtype)`."""

    def __init__(self, source: StackedWeight, count: int, device: torch.device) -> None:
        self.block = source.fp8_block
        self.weight = torch.empty((count, *source.weight.shape[1:]), dtype=source.weight.dtype,
                                  device=device)
        self.scale = torch.empty((count, *source.weight_scale_inv.shape[1:]),
                                 dtype=torch.float32, device=device) if self.block else None

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        if self.scale is None:
            return self.weight[e].to(dtype)
        return dequantize_block_fp8(self.weight[e], self.scale[e], block=self.block, dtype=dtype)

    def fill(self, source: StackedWeight, start: int, end: int, non_blocking: bool) -> None:
        self.weight[start:end].copy_(source.weight[start:end], non_blocking=non_blocking)
        if self.scale is not None:
            self.scale[start:end].copy_(source.weight_scale_inv[start:end],
                                        non_blocking=non_blocking)


def _projections(module: Experts) -> tuple[StackedWeight, StackedWeight, StackedWeight]:
    return module.gate_proj, module.up_proj, module.down_proj


class LayerwiseStreamer:
    """Two full-layer GPU slots shared by all MoE layers, filled one layer ahead."""

    def __init__(self, modules: list[Experts], resident: list[tuple], device: torch.device) -> None:
        self.modules, self.resident, self.device = modules, resident, device
        self.slots = [tuple(DeviceWeights(p, p.weight.shape[0], device)
                            for p in _projections(modules[0])) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="glmflash-layerwise")
        self.pending: dict[int, Future] = {}
        self.bytes_copied = 0

    def acquire(self, index: int) -> tuple:
        """The slot holding layer `index`'s experts, ready on the current stream."""
        if index not in self.pending:
            self._start(index, torch.cuda.current_stream(self.device).record_event())
        done = self.pending.pop(index).result()
        torch.cuda.current_stream(self.device).wait_event(done)
        if index + 1 < len(self.modules):
            # The other slot was last read by layer index-1, queued before this point.
            self._start(index + 1, torch.cuda.current_stream(self.device).record_event())
        return self.slots[index % 2]

    def _start(self, index: int, slot_free: torch.cuda.Event) -> None:
        self.pending[index] = self.worker.submit(self._copy, index, slot_free)

    def _copy(self, index: int, slot_free: torch.cuda.Event) -> torch.cuda.Event:
        module, slot = self.modules[index], self.slots[index % 2]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot_free)
            resident = self.resident[index] or (None, None, None)
            for dst, src, res in zip(slot, _projections(module), resident):
                count = res.weight.shape[0] if res is not None else 0
                if count:
                    dst.weight[:count].copy_(res.weight, non_blocking=True)
                    if dst.scale is not None:
                        dst.scale[:count].copy_(res.scale, non_blocking=True)
                dst.fill(src, count, src.weight.shape[0], non_blocking=True)
                self.bytes_copied += src.weight[count:].numel() * src.weight.element_size()
            return self.copy_stream.record_event()


class HybridExperts:
    """A MoE layer's routed experts split between the GPU (first N) and the CPU kernel."""

    def __init__(self, module: Experts, index: int, placement: ExpertPlacement,
                 device: torch.device, streamer: LayerwiseStreamer | None,
                 resident: tuple | None, executor: ThreadPoolExecutor) -> None:
        self.module, self.index, self.device = module, index, device
        self.num_gpu = placement.num_gpu_experts
        self.threshold = placement.prefill_token_threshold
        self.streamer, self.resident, self.executor = streamer, resident, executor

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.streamer is not None and x.shape[0] >= self.threshold:
            slot = self.streamer.acquire(self.index)
            return experts_loop(x, ids, weights, slot, self.module.limit)
        cpu = self._start_cpu(x, ids, weights)
        if self.num_gpu:
            out = experts_loop(x, torch.where(ids < self.num_gpu, ids, -1), weights,
                               self.resident, self.module.limit)
        else:
            out = torch.zeros_like(x)
        if cpu is not None:
            out = out + cpu.result().to(self.device, non_blocking=True).to(x.dtype)
        return out

    def _start_cpu(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                   ) -> Future | None:
        """Run the CPU experts' (token, expert) pairs on the worker thread."""
        token_idx, slot = torch.where(ids >= self.num_gpu)
        if token_idx.numel() == 0:
            return None
        x_pairs = x[token_idx].float().cpu()
        ids_pairs = ids[token_idx, slot][:, None].cpu()
        w_pairs = weights[token_idx, slot][:, None].float().cpu()
        token_idx, num_tokens = token_idx.cpu(), x.shape[0]
        kernel = self.module.cpu_experts()

        def job() -> torch.Tensor:
            pairs = kernel.forward(x_pairs, ids_pairs, w_pairs)
            return torch.zeros(num_tokens, pairs.shape[1]).index_add_(0, token_idx, pairs)

        return self.executor.submit(job)


def place_experts(model: GlmForCausalLM, placement: ExpertPlacement, device: torch.device) -> None:
    """Attach HybridExperts to every MoE layer of a model whose experts stayed on the CPU."""
    modules = [m for m in model.modules() if isinstance(m, Experts)]
    if not modules:
        return
    num_experts = modules[0].gate_proj.weight.shape[0]
    if not 0 <= placement.num_gpu_experts <= num_experts:
        raise ValueError(f"kt_num_gpu_experts must be in [0, {num_experts}]")
    resident = [_resident(m, placement.num_gpu_experts, device) for m in modules]
    if placement.pin_host_memory and placement.prefill_token_threshold is not None:
        for m in modules:
            _pin(m)
    streamer = LayerwiseStreamer(modules, resident, device) \
        if placement.prefill_token_threshold is not None else None
    executor = ThreadPoolExecutor(1, thread_name_prefix="glmflash-cpu-experts")
    for i, m in enumerate(modules):
        m.backend = HybridExperts(m, i, placement, device, streamer, resident[i], executor)
    logger.info("experts: %d of %d per layer on the GPU, the rest on the CPU; layerwise prefill %s",
                placement.num_gpu_experts, num_experts,
                f"from {placement.prefill_token_threshold} tokens"
                if streamer is not None else "off")


def _resident(module: Experts, count: int, device: torch.device) -> tuple | None:
    if count == 0:
        return None
    weights = tuple(DeviceWeights(p, count, device) for p in _projections(module))
    for dst, src in zip(weights, _projections(module)):
        dst.fill(src, 0, count, non_blocking=False)
    return weights


def _pin(module: Experts) -> None:
    """Page-lock the expert tensors where they are (no copy)."""
    cudart = torch.cuda.cudart()
    for p in _projections(module):
        for t in (p.weight.data, getattr(p, "weight_scale_inv", None)):
            if t is not None and not t.is_pinned():
                cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
