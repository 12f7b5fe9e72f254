"""Layerwise prefill: a long chunk runs every expert of a MoE layer on the GPU from one of two
full-layer GPU slots shared by all MoE layers; the next layer's experts are copied into the other
slot on a side stream while this layer computes. Resident experts come device-to-device, the
others host-to-device (from page-locked host memory)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from glmflash.model.moe import Experts, StackedWeight


class DeviceWeights:
    """Some experts' weights of one projection on a device: `weight` `[count, N, K]`, `scale`
    (None for plain weights) and `fp8_block`, as `grouped_experts` takes them."""

    def __init__(self, source: StackedWeight, count: int, device: torch.device) -> None:
        self.fp8_block = source.fp8_block
        self.weight = torch.empty((count, *source.weight.shape[1:]), dtype=source.weight.dtype,
                                  device=device)
        self.scale = torch.empty((count, *source.weight_scale_inv.shape[1:]),
                                 dtype=torch.float32, device=device) if self.fp8_block else None

    def fill(self, source: StackedWeight, start: int, end: int, non_blocking: bool) -> None:
        """Experts start..end of `source` into the same rows here."""
        self.weight[start:end].copy_(source.weight[start:end], non_blocking=non_blocking)
        if self.scale is not None:
            self.scale[start:end].copy_(source.weight_scale_inv[start:end],
                                        non_blocking=non_blocking)

    def gather(self, source: StackedWeight, ids: list[int]) -> None:
        """Experts `ids` of `source` into rows 0..len(ids)-1 here."""
        for row, e in enumerate(ids):
            self.weight[row].copy_(source.weight[e])
            if self.scale is not None:
                self.scale[row].copy_(source.weight_scale_inv[e])


class LayerwiseStreamer:
    """Two full-layer GPU slots shared by all MoE layers, filled one layer ahead."""

    def __init__(self, modules: list[Experts], resident: list[tuple], resident_ids: list[list[int]],
                 device: torch.device) -> None:
        self.modules, self.resident, self.device = modules, resident, device
        self.resident_ids = resident_ids
        self.resident_rows = [torch.tensor(ids, dtype=torch.long, device=device)
                              for ids in resident_ids]
        self.slots = [tuple(DeviceWeights(p, p.weight.shape[0], device)
                            for p in modules[0].projections()) for _ in range(2)]
        self.copy_stream = torch.cuda.Stream(device)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="glmflash-layerwise")
        self.pending: dict[int, Future] = {}

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
        ids, rows = self.resident_ids[index], self.resident_rows[index]
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(slot_free)
            resident = self.resident[index] or (None, None, None)
            for dst, src, res in zip(slot, module.projections(), resident, strict=True):
                if res is not None:
                    # Resident experts come device-to-device (as bytes: CUDA has no FP8
                    # index_copy), the others from host memory.
                    _bytes(dst.weight).index_copy_(0, rows, _bytes(res.weight))
                    if dst.scale is not None:
                        dst.scale.index_copy_(0, rows, res.scale)
                for start, end in _runs_without(ids, src.weight.shape[0]):
                    dst.fill(src, start, end, non_blocking=True)
            return self.copy_stream.record_event()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _runs_without(ids: list[int], total: int) -> list[tuple[int, int]]:
    """Contiguous ranges of 0..total-1 that avoid `ids`."""
    runs, start = [], 0
    for e in sorted(ids) + [total]:
        if e > start:
            runs.append((start, e))
        start = e + 1
    return runs
