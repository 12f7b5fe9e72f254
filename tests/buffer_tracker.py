"""Which buffers a block of torch code allocates: every op's new output storages, the largest
one of each op, and the peak of those alive at once. Works on any device, so a
CPU test can check that a forward's workspace does not grow with the context."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class BufferTracker(TorchDispatchMode):
    """Counts the storages created inside the `with` block (views and in-place results share an
    input's storage and are not counted; tensors that existed before are inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_by_op: dict[str, int] = {}
        """The largest buffer each op (by aten name) made."""
        self._live: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage_ptr(t) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor, inputs, func)
        return out

    def _count(self, tensor: torch.Tensor, inputs: set[int], func) -> None:
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or ptr in inputs or ptr in self._live:
            return
        self._live[ptr] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        name = str(func)
        self.largest_by_op[name] = max(nbytes, self.largest_by_op.get(name, 0))
        weakref.finalize(storage, self._release, ptr)

    def _release(self, ptr: int) -> None:
        self.live_bytes -= self._live.pop(ptr, 0)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()
