"""The hand-off of a MoE layer's CPU experts in hybrid decode (used by engine/experts.py).

Order per layer (main = the current stream):
1. main: routing, then the CPU part's ids (resident experts set to -1);
2. side stream: waits for main, copies x, those ids and the weights into pinned host buffers,
   records `ready`;
3. worker thread: `ready.synchronize()` (the worker waits for the GPU, never the main thread),
   then the CPU kernel over all T tokens into the pinned output;
4. main, meanwhile: the resident experts and the shared expert are queued;
5. main: waits for the worker's future (a host wait, no GPU sync), copies the output to the GPU
   on main (non-blocking) and adds it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ExpertTimes:
    """What the experts of hybrid decode took, summed over calls (seconds)."""

    num_calls: int = 0
    """Calls that ran CPU experts."""
    cpu_s: float = 0.0
    """The CPU kernel's wall time, measured on the worker thread."""
    wait_s: float = 0.0
    """The main thread's wait for the CPU result: CPU time not hidden under the GPU's work."""
    gpu_s: float = 0.0
    """GPU time from the hand-off to the end of the resident and shared experts (CUDA events;
    only while timing is on)."""

    def add(self, other: ExpertTimes) -> None:
        self.num_calls += other.num_calls
        self.cpu_s += other.cpu_s
        self.wait_s += other.wait_s
        self.gpu_s += other.gpu_s


class CpuHandOff:
    """Runs CPU expert kernels on one worker thread, fed through pinned host buffers by copies
    on a side stream. One per model: its MoE layers run one after another.

    NOTE: every layer reuses the same pinned buffers without double buffering:
    - inputs: a layer's copies are queued after the previous layer's job has returned;
    - output: a layer's job writes it only after `ready`, which the side stream records after
      waiting for main, where the previous layer's copy out of the buffer was queued.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.ready = torch.cuda.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="glmflash-cpu-experts")
        self.buffers: tuple[torch.Tensor, ...] = ()
        """Pinned x `[n, D]` (x's dtype), ids `[n, k]` int64, weights `[n, k]` fp32, output
        `[n, D]` fp32, grown to the largest token count seen."""

    def submit(self, kernel, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
               ) -> Future:
        """Run `kernel.forward` over (x, ids, weights) once they reach the host (ids < 0 are
        skipped); the future gives the kernel's wall time in seconds. The caller keeps the
        inputs alive until the future has resolved."""
        x_host, ids_host, weights_host, out_host = self._views(x, ids)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            x_host.copy_(x, non_blocking=True)
            ids_host.copy_(ids, non_blocking=True)
            weights_host.copy_(weights, non_blocking=True)
            self.ready.record(self.stream)
        return self.executor.submit(_run_on_worker, kernel, self.ready, x_host, ids_host,
                                    weights_host, out_host)

    def output(self, num_tokens: int) -> torch.Tensor:
        """The last job's output `[T, D]` fp32, copied to the GPU on the current stream; call
        after its future has resolved."""
        return self.buffers[3][:num_tokens].to(self.device, non_blocking=True)

    def _views(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        num_tokens, hidden = x.shape
        top_k = ids.shape[1]
        fits = self.buffers and self.buffers[0].shape[0] >= num_tokens and \
            self.buffers[0].shape[1] == hidden and self.buffers[0].dtype == x.dtype and \
            self.buffers[1].shape[1] == top_k
        if not fits:
            # NOTE: a replaced buffer may still feed a queued copy; the pinned allocator
            # keeps its block until the copies recorded on it have run.
            n = max(16, 1 << (num_tokens - 1).bit_length())
            self.buffers = (
                torch.empty(n, hidden, dtype=x.dtype, pin_memory=True),
                torch.empty(n, top_k, dtype=torch.int64, pin_memory=True),
                torch.empty(n, top_k, dtype=torch.float32, pin_memory=True),
                torch.empty(n, hidden, dtype=torch.float32, pin_memory=True))
        return tuple(b[:num_tokens] for b in self.buffers)


def _run_on_worker(kernel, ready: torch.cuda.Event, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor) -> float:
    ready.synchronize()
    begin = time.perf_counter()
    # NOTE: the buffers were made under the model's inference mode; a thread does not inherit
    # it, and in-place writes to inference tensors are refused outside it.
    with torch.inference_mode():
        kernel.forward(x, ids, weights, out=out)
    return time.perf_counter() - begin
