"""Host-to-device uploads that never block the host on the device's queue."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch


class UploadMemo:
    """One device tensor per distinct uploaded value, for capturing a CUDA graph of a forward
    whose integer inputs are fixed (training steps of one shape).

    A graph records an asynchronous copy from page-locked memory as a read of that memory at
    every replay, long after the staging block went back to its allocator; with the memo
    installed (`remembered_uploads`), warm-up runs make each value's device tensor once, outside
    the graph, and the capture only reuses them. `frozen`: a value not seen before is an error
    (it would change between replays)."""

    def __init__(self) -> None:
        self.tensors: dict[tuple, torch.Tensor] = {}
        self.frozen = False

    def get(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
        key = (str(device), host.dtype, tuple(host.shape),
               host.reshape(-1).view(torch.uint8).numpy().tobytes())
        tensor = self.tensors.get(key)
        if tensor is None:
            if self.frozen:
                raise RuntimeError(f"an upload of shape {tuple(host.shape)} was not seen before "
                                   "the capture: its values change between replays")
            tensor = self.tensors[key] = host.to(device, copy=True)
        return tensor


_memo: UploadMemo | None = None


@contextlib.contextmanager
def remembered_uploads(memo: UploadMemo) -> Iterator[UploadMemo]:
    """Route every `upload` through `memo` while the context is open."""
    global _memo
    previous, _memo = _memo, memo
    try:
        yield memo
    finally:
        _memo = previous


def upload(values: np.ndarray | list[int], device: torch.device | str,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` as a tensor on `device`, copied without a host sync.

    On CUDA the data goes through page-locked memory from torch's caching host allocator, so the
    copy is asynchronous and the staging block is not reused before the copy has run.
    NOTE: while an `UploadMemo` is installed, equal values share one tensor: treat it as
    read-only.
    """
    host = torch.as_tensor(np.asarray(values), dtype=dtype)
    device = torch.device(device)
    if _memo is not None:
        return _memo.get(host, device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
