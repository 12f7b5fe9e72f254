"""Loading one rank's part of the checkpoint: each split tensor is read through a safetensors
slice (only this rank's rows or columns leave the file), each scale grid is mapped onto the
shard, and the experts of other ranks are not read at all."""

from __future__ import annotations

import re

import torch

from glmflash.distributed.sharding import ShardPlan
from glmflash.model.weights import CheckpointLayout

_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.")


class ShardedCheckpoint(CheckpointLayout):
    def __init__(self, plan: ShardPlan, params: set[str]) -> None:
        self.plan = plan
        self.params = params
        self.first, self.count = plan.experts

    def skip_reason(self, name: str) -> str | None:
        if self.count == 0 and _ROUTED.search(name):
            return "routed experts held by rank 0"
        return None

    def local_expert(self, target: str, index: int) -> int | None:
        local = index - self.first
        return local if 0 <= local < self.count else None

    def read(self, handle, name: str, target: str) -> torch.Tensor:
        if target in self.plan.scale_grids:
            return _regrid_scales(handle.get_tensor(name), *self.plan.scale_grids[target])
        dim = self.plan.split_dims.get(target)
        if dim is None:
            return handle.get_tensor(name)
        part = handle.get_slice(name)
        shape = part.get_shape()
        size = shape[dim] // self.plan.parallel.tp_size
        start = self.plan.parallel.rank * size
        index = tuple(slice(start, start + size) if d == dim else slice(None)
                      for d in range(len(shape)))
        return part[index]


def _regrid_scales(scales: torch.Tensor, block: int, sub: int, row: int, col: int,
                   num_rows: int, num_cols: int) -> torch.Tensor:
    """The `[..., num_rows, num_cols]` scales of a shard starting at (row, col) of the full
    weight, on a `sub` grid. Local block i of a dimension covers full rows from
    `offset + i * sub`, all inside one checkpoint block (`sub` divides `block` and the offset),
    whose scale it takes."""
    row_index = (row + torch.arange(num_rows) * sub) // block
    col_index = (col + torch.arange(num_cols) * sub) // block
    return scales[..., row_index, :][..., col_index].contiguous()
