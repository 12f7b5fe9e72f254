"""CPU experts inside a captured decode graph: the CUDA side of kernels/cpu_moe/graph_serve.py.

Per MoE layer the graph holds (main = the capture stream):
1. main: the CPU part's expert ids (resident experts and padding rows set to -1), x in fp32 and
   the routing weights, written into device staging buffers;
2. a side stream: copies of those into page-locked host buffers, then the host node that hands
   the layer to the serving loop and returns once it is done, then the copy of the output back;
3. main, meanwhile: the resident and the shared experts; then it joins the side stream and adds.
Layers reuse the same buffers: a layer's staging writes are queued on main after main has joined
the previous layer's side work. Per step the host writes only the number of live rows, in stream
order before the replay (`set_live_rows`).
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch

from glmflash.kernels.cpu_moe.graph_serve import ExpertServer, hand_off_address

logger = logging.getLogger(__name__)


class CpuExpertsFailed(RuntimeError):
    """The serving loop of the CPU experts inside the graphs has stopped: every later replay
    would run without them, so the engine stops (engine/loop.py `is_device_lost`)."""

    ends_engine = True


class GraphHandOff:
    """Buffers, side stream and serving loop shared by every hybrid MoE layer of one model."""

    def __init__(self, kernels: list, max_rows: int, top_k: int, device: torch.device) -> None:
        hidden = kernels[0].hidden
        self.device, self.max_rows = device, max_rows
        shapes = ((max_rows, hidden, np.float32), (max_rows, top_k, np.int64),
                  (max_rows, top_k, np.float32), (max_rows, hidden, np.float32))
        self._host = [_registered(np.zeros(shape[:2], shape[2])) for shape in shapes]
        x, ids, weights, out = (torch.from_numpy(a) for a in self._host)
        self.host_inputs, self.host_out = (x, ids, weights), out
        self.staged = tuple(torch.zeros_like(t, device=device) for t in (x, ids, weights, out))
        self.live_rows = torch.zeros((), dtype=torch.int64, device=device)
        self.stream = torch.cuda.Stream(device)
        self.server = ExpertServer(kernels, *self._host)
        self.server.start()
        self._launch_host_func = _host_func_launcher()

    def set_live_rows(self, num_rows: int) -> None:
        """Rows from `num_rows` on are padding: their CPU experts are skipped."""
        self.live_rows.fill_(num_rows)

    def start(self, layer: int, x: torch.Tensor, cpu_ids: torch.Tensor,
              weights: torch.Tensor) -> None:
        """Queue layer `layer`'s CPU experts over x `[R, D]` (ids < 0 skipped)."""
        rows = x.shape[0]
        main = torch.cuda.current_stream(self.device)
        live = torch.arange(rows, device=x.device)[:, None] < self.live_rows
        staged_x, staged_ids, staged_weights, staged_out = self.staged
        staged_ids[:rows].copy_(torch.where(live, cpu_ids, -1))
        staged_x[:rows].copy_(x)
        staged_weights[:rows].copy_(weights)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            for host, staged in zip(self.host_inputs, self.staged[:3], strict=True):
                host[:rows].copy_(staged[:rows], non_blocking=True)
            self._launch_host_func(self.stream.cuda_stream, self.server.hand_off_arg(layer, rows))
            staged_out[:rows].copy_(self.host_out[:rows], non_blocking=True)

    def finish(self, rows: int, dtype: torch.dtype) -> torch.Tensor:
        """The output of the layer started last, joined into the current stream."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        return self.staged[3][:rows].to(dtype)

    def check(self) -> None:
        """Raise if the serving loop has failed (its replays then returned without experts).
        The loop sets its failure before the waiting host node returns, so once the host has
        waited for a replay's outputs, a failure during that replay is seen here."""
        if self.server.failed:
            raise CpuExpertsFailed(f"CPU experts of the captured decode failed: "
                                   f"{self.server.error}")

    def close(self) -> None:
        self.server.stop()
        for array in self._host:
            torch.cuda.cudart().cudaHostUnregister(array.ctypes.data)
        self._host = []


def _registered(array: np.ndarray) -> np.ndarray:
    """Page-lock a numpy array in place (copies to and from it run as DMA, also in graphs).

    NOTE: memory locked this way is not torch's caching host allocator's, so copies in a
    captured graph record no allocator events.
    """
    torch.cuda.cudart().cudaHostRegister(array.ctypes.data, array.nbytes, 0)
    return array


def _host_func_launcher():
    """`launch(stream, arg)`: queue the hand-off host node on a CUDA stream (driver API, so it
    is captured into graphs as a host node)."""
    driver = ctypes.CDLL("libcuda.so.1")
    launch_host_func = driver.cuLaunchHostFunc
    launch_host_func.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    launch_host_func.restype = ctypes.c_int
    function = hand_off_address()

    def launch(stream: int, arg: int) -> None:
        error = launch_host_func(stream, function, arg)
        if error:
            raise RuntimeError(f"cuLaunchHostFunc failed with CUDA error {error}")
    return launch
