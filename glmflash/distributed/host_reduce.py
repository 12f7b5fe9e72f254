"""All-reduce through shared memory for CPU ranks on one host.

gloo's all-reduce of a few hundred bytes costs a millisecond or more between two processes of a
small machine (wake-ups through the network stack), and a decode step makes two per layer. Here
each rank copies its tensor into its slot of a shared segment, publishes the call's sequence
number, waits (spinning, then yielding the core) until every rank has published it, and sums
the slots in rank order, so every rank computes the same bits. Slots are double-buffered by the
sequence number's parity: a rank writes a buffer again only after every rank has published the
next call, which each does only after it finished reading this one.

Stores are published in program order (x86's TSO), which the flag-after-data protocol relies on;
`HostAllReduce.supported()` is False elsewhere and the caller keeps gloo. Tensors larger than a
slot also take gloo (every rank decides the same way: the shapes are the same on every rank).
A rank that waits past the timeout, sees the abort flag (rank 0 sets it when another rank
dies) or loses its parent (a spawned rank whose rank 0 died) raises a `DistError`.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20
"""Largest tensor reduced here (decode steps and small chunks; larger ones take gloo)."""
_HEADER = 64
"""Bytes before the flags: [0] the abort flag."""
_SPINS_BEFORE_YIELD = 64
_SPINS_PER_CHECK = 1024


class HostAllReduce:
    """One shared segment for `world_size` ranks of one host (rank 0 creates and unlinks it)."""

    def __init__(self, segment: shared_memory.SharedMemory, rank: int, world_size: int,
                 timeout_s: float, owner: bool) -> None:
        self.segment, self.rank, self.world_size = segment, rank, world_size
        self.timeout_s, self.owner = timeout_s, owner
        self.control = np.ndarray((_HEADER // 8,), dtype=np.int64, buffer=segment.buf)
        self.flags = np.ndarray((2, world_size), dtype=np.int64, buffer=segment.buf,
                                offset=_HEADER)
        data_offset = _HEADER + 16 * world_size
        self.slots = np.ndarray((2, world_size, SLOT_BYTES), dtype=np.uint8, buffer=segment.buf,
                                offset=data_offset)
        self.sequence = 0
        self.parent = os.getppid()

    @staticmethod
    def size(world_size: int) -> int:
        return _HEADER + 16 * world_size + 2 * world_size * SLOT_BYTES

    @staticmethod
    def supported(world_size: int) -> bool:
        """x86 (store order) and room in /dev/shm for the segment, twice over."""
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return False
        try:
            return shutil.disk_usage("/dev/shm").free >= 2 * HostAllReduce.size(world_size)
        except OSError:
            return False

    @classmethod
    def create(cls, world_size: int, timeout_s: float) -> HostAllReduce:
        segment = shared_memory.SharedMemory(create=True, size=cls.size(world_size))
        np.ndarray((_HEADER // 8 + 2 * world_size,), dtype=np.int64, buffer=segment.buf)[:] = 0
        return cls(segment, 0, world_size, timeout_s, owner=True)

    @classmethod
    def attach(cls, name: str, rank: int, world_size: int, timeout_s: float) -> HostAllReduce:
        # NOTE: spawned ranks share rank 0's resource tracker, where attaching registers the
        # name again (a set: no change); rank 0 unlinks and unregisters it once, at close.
        segment = shared_memory.SharedMemory(name=name)
        return cls(segment, rank, world_size, timeout_s, owner=False)

    @property
    def name(self) -> str:
        return self.segment.name

    def all_reduce(self, tensor: torch.Tensor) -> bool:
        """Sum `tensor` over the ranks in place; False (nothing done) when it does not fit."""
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or nbytes > SLOT_BYTES:
            return False
        self.sequence += 1
        buffer = self.sequence & 1
        self.slots[buffer, self.rank, :nbytes] = tensor.view(-1).view(torch.uint8).numpy()
        self.flags[buffer, self.rank] = self.sequence
        self._wait(buffer)
        parts = [torch.from_numpy(self.slots[buffer, r, :nbytes]).view(tensor.dtype)
                 for r in range(self.world_size)]
        flat = tensor.view(-1)
        flat.copy_(parts[0])
        for part in parts[1:]:
            flat.add_(part)
        return True

    def abort(self) -> None:
        """Make every rank waiting here raise (a rank died)."""
        self.control[0] = 1

    def close(self) -> None:
        self.control = self.flags = self.slots = None
        self.segment.close()
        if self.owner:
            self.segment.unlink()

    def _wait(self, buffer: int) -> None:
        flags, sequence = self.flags[buffer], self.sequence
        spins, deadline = 0, None
        while (flags != sequence).any():
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()
            if spins % _SPINS_PER_CHECK == 0:
                deadline = deadline or time.monotonic() + self.timeout_s
                self._check(deadline)

    def _check(self, deadline: float) -> None:
        if self.control[0]:
            raise dist.DistError("shared-memory all-reduce aborted: a rank exited")
        if self.rank and os.getppid() != self.parent:
            raise dist.DistError("shared-memory all-reduce: rank 0 exited")
        if time.monotonic() > deadline:
            raise dist.DistError(f"shared-memory all-reduce: not every rank arrived within "
                                 f"{self.timeout_s:.0f} s")
