"""State snapshots for the prefix cache: copies of state slots kept beside the ModelState.

A snapshot holds what a state slot holds (every KDA layer's recurrent and conv state, every full
indexer's raw tail) at one position of one prefix; a sequence that starts from that prefix gets a
copy in its own slot, so the snapshot stays unchanged. Which snapshot belongs to which prefix is
decided outside (the engine's prefix cache).
"""

from __future__ import annotations

import numpy as np
import torch

from glmflash.model.state import ModelState
from glmflash.utils.device import upload

STATE_SLOT_FIELDS = ("recurrent", "conv", "index_tail")


class StateSnapshots:
    def __init__(self, state: ModelState, num_snapshots: int) -> None:
        self.num_snapshots = num_snapshots
        self.tensors: dict[str, dict[int, torch.Tensor]] = {
            name: {layer: torch.zeros((num_snapshots, *t.shape[1:]), dtype=t.dtype,
                                      device=t.device)
                   for layer, t in getattr(state, name).items()}
            for name in STATE_SLOT_FIELDS}

    def save(self, state: ModelState, slots: list[int], snapshots: list[int]) -> None:
        """snapshot[snapshots[i]] = state slot[slots[i]] (distinct snapshots)."""
        src, dst = _indices(slots, snapshots, self._device)
        for name in STATE_SLOT_FIELDS:
            for layer, t in getattr(state, name).items():
                self.tensors[name][layer].index_copy_(0, dst, t.index_select(0, src))

    def load(self, state: ModelState, snapshots: list[int], slots: list[int]) -> None:
        """state slot[slots[i]] = snapshot[snapshots[i]] (distinct slots)."""
        src, dst = _indices(snapshots, slots, self._device)
        for name in STATE_SLOT_FIELDS:
            for layer, t in getattr(state, name).items():
                t.index_copy_(0, dst, self.tensors[name][layer].index_select(0, src))

    @property
    def _device(self) -> torch.device:
        return next(t.device for group in self.tensors.values() for t in group.values())


def copy_pages(state: ModelState, sources: list[int], targets: list[int], page_size: int) -> None:
    """Token slots of page `targets[i]` = those of page `sources[i]`: MLA latents and the pooled
    indexer keys (page_size is a multiple of kpool, so a page holds whole pools)."""
    device = next(iter(state.latent.values())).device
    offsets = np.arange(page_size, dtype=np.int64)
    src_pages, dst_pages = np.asarray(sources, np.int64), np.asarray(targets, np.int64)
    src = (src_pages[:, None] * page_size + offsets).reshape(-1)
    dst = (dst_pages[:, None] * page_size + offsets).reshape(-1)
    src_slots, dst_slots = _indices(src, dst, device)
    for t in state.latent.values():
        t.index_copy_(0, dst_slots, t.index_select(0, src_slots))
    if state.pool_keys:
        kpool = state.num_token_slots // next(iter(state.pool_keys.values())).shape[0]
        src_pools, dst_pools = _indices(src[::kpool] // kpool, dst[::kpool] // kpool, device)
        for t in state.pool_keys.values():
            t.index_copy_(0, dst_pools, t.index_select(0, src_pools))


def _indices(a, b, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two equal-length integer lists as device tensors, in one upload."""
    both = upload(np.concatenate([np.asarray(a, np.int64), np.asarray(b, np.int64)]), device)
    return both[: len(a)], both[len(a):]
