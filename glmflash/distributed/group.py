"""The ranks' process groups and how a failure travels between them.

* The model group carries the all-reduces: NCCL on GPUs, gloo on CPUs, with a timeout.
* The control group (gloo, on the host) carries rank 0's step messages; it has no practical
  timeout, since the other ranks wait on it for as long as the server is idle.
* The store (the rendezvous TCPStore) is where a failing rank leaves its error before exiting,
  so that rank 0 can say which rank failed and why, not only that a connection closed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from glmflash.distributed.host_reduce import HostAllReduce

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=7)
ERROR_KEY = "glmflash/error/{rank}"
HOST_REDUCE_KEY = "glmflash/host_reduce"
# How long rank 0 waits for the failing rank's own message after a collective breaks.
ERROR_WAIT_S = 3.0


class RankFailed(RuntimeError):
    """A rank failed (at load or in a step): every rank stops. Says which rank and why."""

    ends_engine = True
    """The engine loop stops on it (the ranks are out of step: no later step can run)."""


@dataclass
class RankGroup:
    rank: int
    world_size: int
    device: torch.device
    store: Any
    control: Any
    backend: str
    host_reduce: HostAllReduce | None = None
    """Small all-reduces of CPU ranks on one host, through shared memory."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.host_reduce is None or not self.host_reduce.all_reduce(tensor):
            dist.all_reduce(tensor)

    def send(self, message: object) -> None:
        """Rank 0: one message to every other rank, in order."""
        dist.broadcast_object_list([message], src=0, group=self.control)

    def receive(self) -> object:
        """Other ranks: the next message from rank 0 (waits for as long as rank 0 is idle)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def exchange(self, value: object) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.control)
        return values

    def post_error(self, text: str) -> None:
        """Leave this rank's error where rank 0 looks for it (best effort: rank 0 may be gone)."""
        try:
            self.store.set(ERROR_KEY.format(rank=self.rank), text)
        except Exception:
            logger.debug("could not post the error to the store", exc_info=True)

    def posted_errors(self, wait_s: float = 0.0) -> dict[int, str]:
        """Errors the other ranks left, waiting up to `wait_s` for the first one."""
        deadline = time.monotonic() + wait_s
        while True:
            found = {}
            for rank in range(self.world_size):
                key = ERROR_KEY.format(rank=rank)
                if rank != self.rank and self.store.check([key]):
                    found[rank] = self.store.get(key).decode(errors="replace")
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def close(self) -> None:
        if self.host_reduce is not None:
            self.host_reduce.close()
            self.host_reduce = None
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(rank: int, world_size: int, store, device_type: str, timeout_s: float,
               same_host: bool = False) -> RankGroup:
    """Join the model and control groups (every rank calls it, rank 0 included). CPU ranks
    that rank 0 spawned on its host (`same_host`) also share a segment for small all-reduces."""
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    logger.info("rank %d of %d joined (%s on %s)", rank, world_size, backend, device)
    host_reduce = _host_reduce(rank, world_size, store, timeout_s) \
        if same_host and backend == "gloo" else None
    return RankGroup(rank, world_size, device, store, control, backend, host_reduce)


def _host_reduce(rank: int, world_size: int, store, timeout_s: float) -> HostAllReduce | None:
    """Rank 0 makes the segment (if this host can) and says its name; the others follow."""
    if rank == 0:
        made = HostAllReduce.create(world_size, timeout_s) \
            if HostAllReduce.supported(world_size) else None
        store.set(HOST_REDUCE_KEY, made.name if made is not None else "")
        return made
    name = store.get(HOST_REDUCE_KEY).decode()
    return HostAllReduce.attach(name, rank, world_size, timeout_s) if name else None


def abort_group() -> None:
    """Unblock this process's pending collectives (NCCL waits until its timeout otherwise)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_initialized():
        abort()
