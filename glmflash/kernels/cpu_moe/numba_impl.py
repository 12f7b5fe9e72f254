"""CPU routed experts on block-FP8 weights: `NumbaMoeExperts`, which owns a layer's weights,
thread pools and scratch buffers and runs the Numba kernels (derivation in README.md).

Weights stay in their checkpoint layout (`[E, I, D]`, `[E, D, I]`, FP8 = 1 byte each, zero-copy
views of the torch tensors): every row block of one expert is already contiguous. With K thread
pools (`pools.py`) each pool reads a copy of the weights placed on its NUMA node. The kernels are
in numba_kernels.py, their LLVM-IR inner loop in llvm_ir.py, the choice of e4m3 decode in
decode_choice.py.

This module imports numba at the top; the package imports it lazily (`cpu_moe.__init__`).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import numba
import numpy as np
import torch

from glmflash.kernels.cpu_moe import pools
from glmflash.kernels.cpu_moe.decode_choice import DECODES, default_decode
from glmflash.kernels.cpu_moe.numba_kernels import (
    ACC_WIDTH,
    BLOCK,
    COUNTER_STRIDE,
    ROW_GROUP,
    TOKEN_GROUP,
    _down_nb,
    _gate_up_nb,
    _group_nb,
    _place_rows_nb,
)

logger = logging.getLogger(__name__)


def _fp8_bytes(weight: torch.Tensor) -> np.ndarray:
    """Zero-copy int8 view of an FP8 tensor's bytes."""
    assert weight.dtype == torch.float8_e4m3fn and weight.is_contiguous()
    return weight.view(torch.uint8).numpy().view(np.int8)


class WorkerTrace(NamedTuple):
    """Debug record of one forward (`NumbaMoeExperts.record_workers`): which worker computed
    each row."""

    hit_ids: np.ndarray
    """[hit] experts hit, in the order of the rows of `gate_up`."""
    gate_up: np.ndarray
    """[hit, I] int64: worker of each gate/up row of each hit expert."""
    down: np.ndarray
    """[D] int64: worker of each output row."""


_NO_TRACE_2D = np.zeros((0, 0), np.int64)
_NO_TRACE_1D = np.zeros(0, np.int64)


def _check_shapes(gate_w, gate_s, up_w, up_s, down_w, down_s, block: int) -> None:
    num_experts, inter, hidden = gate_w.shape
    shape_gu = (num_experts, -(-inter // block), -(-hidden // block))
    shape_down = (num_experts, -(-hidden // block), -(-inter // block))
    if up_w.shape != gate_w.shape or down_w.shape != (num_experts, hidden, inter):
        raise ValueError(f"expert shapes differ: {gate_w.shape}, {up_w.shape}, {down_w.shape}")
    if gate_s.shape != shape_gu or up_s.shape != shape_gu or down_s.shape != shape_down:
        raise ValueError(f"scale shapes {gate_s.shape}, {up_s.shape}, {down_s.shape} do not "
                         f"fit block {block}")
    if block % 32:
        raise ValueError(f"block {block} must be a multiple of 32")


@functools.cache
def _log_layout(num_pools: int, threads_per_pool: tuple[int, ...], cpus: str, layer: str) -> None:
    logger.info("CPU experts: %d pool(s), threads per pool %s, %s, numba threading layer %s",
                num_pools, "/".join(map(str, threads_per_pool)), cpus, layer)


class NumbaMoeExperts:
    """Routed experts of one MoE layer on CPU.

    With one pool the weights are borrowed (zero-copy). With `num_pools` K > 1, K thread pools
    each own a slice of every expert's rows (`pools.py`), and each weight is copied once into a
    fresh allocation, every pool's rows by that pool's threads, so the pages sit on the pool's
    NUMA node (first touch). `weight_tensors` are then those copies: the caller should hold them
    in place of the originals, or the memory is doubled.

    NOTE: the scratch buffers are per instance, so one forward at a time per instance.
    """

    def __init__(self, gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor,
                 up_s: torch.Tensor, down_w: torch.Tensor, down_s: torch.Tensor, *,
                 swiglu_limit: float, num_threads: int | None = None, num_pools: int = 1,
                 pool_cpus: list[list[int]] | None = None, block: int = BLOCK,
                 decode: str | None = None):
        """`pool_cpus`: CPUs each pool's threads are pinned to (default: the NUMA nodes, see
        `pools.pool_cpus`; unpinned when they do not split into `num_pools`). `decode`: "fp16"
        or "fp32-bits" (default: `default_decode()` of these weights)."""
        _check_shapes(gate_w, gate_s, up_w, up_s, down_w, down_s, block)
        self.num_experts, self.inter, self.hidden = gate_w.shape
        self.num_threads = num_threads or numba.config.NUMBA_NUM_THREADS
        numba.set_num_threads(self.num_threads)
        self.swiglu_limit = float(swiglu_limit)
        self.block = block
        self.decode_name = decode or default_decode(gate_w, up_w, down_w)
        if self.decode_name not in DECODES:
            raise ValueError(f"unknown e4m3 decode {self.decode_name!r}; expected one of "
                             f"{tuple(DECODES)}")
        self.decode = DECODES[self.decode_name]
        self._init_pools(num_pools, pool_cpus)
        self.weight_tensors = (self._place(gate_w, self._gate_up_rows),
                               self._place(up_w, self._gate_up_rows),
                               self._place(down_w, self._down_rows))
        """The FP8 weights read: the arguments with one pool, their placed copies with several."""
        # zero-copy views: weight_tensors keeps their storage alive
        self.gate_w, self.up_w, self.down_w = (_fp8_bytes(w) for w in self.weight_tensors)
        self.gate_s, self.up_s, self.down_s = (
            np.ascontiguousarray(s.float().numpy()) for s in (gate_s, up_s, down_s))
        width = max(self.hidden, self.inter)
        self._scratch = np.zeros((self.num_threads, 2, TOKEN_GROUP, width), np.float32)
        self._acc = np.zeros((self.num_threads, 2, ROW_GROUP, ACC_WIDTH), np.float32)
        self._counts = np.zeros(self.num_experts, np.int64)
        self.record_workers = False
        """Debug: when True, each forward leaves a `WorkerTrace` in `worker_trace`."""
        self.worker_trace: WorkerTrace | None = None
        self._reserve(8)

    def _init_pools(self, num_pools: int, pool_cpus: list[list[int]] | None) -> None:
        if not 1 <= num_pools <= self.num_threads:
            raise ValueError(f"num_pools {num_pools} must be between 1 and num_threads "
                             f"({self.num_threads}): every pool needs a thread")
        pool_cpus = pools.pool_cpus(num_pools) if pool_cpus is None else pool_cpus
        if pool_cpus is not None and (len(pool_cpus) != num_pools or not all(pool_cpus)):
            raise ValueError(f"pool_cpus {pool_cpus} must list some CPUs for each of the "
                             f"{num_pools} pools")
        self.num_pools, self.pool_cpus = num_pools, pool_cpus
        self._gate_up_rows = pools.split_rows(self.inter, num_pools, self.block, ROW_GROUP)
        self._down_rows = pools.split_rows(self.hidden, num_pools, self.block, ROW_GROUP)
        self._cpu_masks = pools.cpu_masks(pool_cpus)
        self._task_counter = np.zeros(num_pools * COUNTER_STRIDE, np.int64)

    def _place(self, weight: torch.Tensor, pool_rows: np.ndarray) -> torch.Tensor:
        """The weight itself with one pool, else a copy whose rows each pool's threads wrote."""
        if self.num_pools == 1:
            return weight
        src = _fp8_bytes(weight)
        # a fresh large allocation is mmap-backed: no page exists until the copy touches it
        placed = torch.empty_like(weight, memory_format=torch.contiguous_format)
        with pools.keeping_thread_affinity(self.pool_cpus is not None):
            _place_rows_nb(src, pool_rows, self._cpu_masks, self._task_counter,
                           self.num_threads, _fp8_bytes(placed))
        return placed

    def _reserve(self, num_pairs: int) -> None:
        """Grow the per-pair buffers (pair lists and the hidden activations h) to num_pairs."""
        if getattr(self, "_h", None) is not None and self._h.shape[0] >= num_pairs:
            return
        self._hit_ids = np.zeros(num_pairs, np.int64)
        self._pair_offsets = np.zeros(num_pairs + 1, np.int64)
        self._pair_token_ids = np.zeros(num_pairs, np.int64)
        self._pair_weights = np.zeros(num_pairs, np.float32)
        self._h = np.zeros((num_pairs, self.inter), np.float32)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D], topk_ids [T, k] int (< 0: skip the pair), topk_weights [T, k] -> [T, D]
        fp32 (or into `out`)."""
        num_tokens = x.shape[0]
        if x.ndim != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x {tuple(x.shape)} does not match hidden {self.hidden}")
        if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
            raise ValueError(f"topk shapes {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        if out is None:
            out = torch.zeros(num_tokens, self.hidden, dtype=torch.float32)
        else:
            assert out.shape == (num_tokens, self.hidden) and out.dtype == torch.float32
            assert out.is_contiguous()
            out.zero_()
        if numba.get_num_threads() != self.num_threads:
            numba.set_num_threads(self.num_threads)
        x_np = x.detach().to(torch.float32).contiguous().numpy()
        ids = topk_ids.detach().to(torch.int64).contiguous().numpy()
        weights = topk_weights.detach().to(torch.float32).contiguous().numpy()
        self._reserve(ids.size)
        num_hit = _group_nb(ids, weights, self._counts, self._hit_ids, self._pair_offsets,
                            self._pair_token_ids, self._pair_weights)
        if num_hit:
            self._run(x_np, self._hit_ids[:num_hit], out.numpy())
        return out

    def _run(self, x_np: np.ndarray, hit_ids: np.ndarray, out_np: np.ndarray) -> None:
        """Both parallel phases over the grouped pairs."""
        trace = WorkerTrace(hit_ids.copy(), np.full((hit_ids.size, self.inter), -1),
                            np.full(self.hidden, -1)) if self.record_workers else None
        with pools.keeping_thread_affinity(self.pool_cpus is not None):
            _gate_up_nb(x_np, self.gate_w, self.gate_s, self.up_w, self.up_s, hit_ids,
                        self._pair_offsets, self._pair_token_ids, np.float32(self.swiglu_limit),
                        self.decode, self.block, self._gate_up_rows, self._cpu_masks, self._scratch,
                        self._acc, self._task_counter,
                        _NO_TRACE_2D if trace is None else trace.gate_up, self._h)
            _down_nb(self._h, self.down_w, self.down_s, hit_ids, self._pair_offsets,
                     self._pair_token_ids, self._pair_weights, self.decode, self.block,
                     self._down_rows, self._cpu_masks, self._scratch, self._acc,
                     self._task_counter,
                     _NO_TRACE_1D if trace is None else trace.down, out_np)
        self.worker_trace = trace

    def warmup(self) -> None:
        """Compile (or load from cache) every kernel with one token on expert 0; log the pools
        once per process."""
        x = torch.zeros(1, self.hidden, dtype=torch.float32)
        self.forward(x, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1))
        threads = np.bincount(pools.pool_of_workers(self.num_threads, self.num_pools))
        _log_layout(self.num_pools, tuple(int(t) for t in threads),
                    pools.describe_pinning(self.num_pools, self.pool_cpus),
                    numba.threading_layer())
