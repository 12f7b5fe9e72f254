"""Thread subpools of the CPU expert kernel (`--kt-threadpool-count`): who owns which rows, and
which CPUs each pool's threads run on. No numba here: the kernels live in `numba_impl.py`.

Worker w of T belongs to pool `w * K // T`. Pool p owns rows [bounds[p], bounds[p + 1]) of every
expert's gate/up (intermediate rows) and of its down projection (output rows).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

NODE_ROOT = Path("/sys/devices/system/node")
# glibc's cpu_set_t: 1024 CPUs in 64-bit words
_MIN_MASK_WORDS = 16


def pool_of_workers(num_workers: int, num_pools: int) -> np.ndarray:
    """[num_workers] pool of each worker (the rule the kernels compute inline)."""
    return np.arange(num_workers) * num_pools // num_workers


def split_rows(num_rows: int, num_pools: int, block: int, row_group: int) -> np.ndarray:
    """[num_pools + 1] int64 pool boundaries over num_rows rows.

    Block-aligned when every pool can own a block, else multiples of `row_group` (so row groups
    start where they do with one pool and the sums are bit-equal); pools may then be empty.
    """
    align = block if num_rows >= num_pools * block else row_group
    units = -(-num_rows // align)
    bounds = [min(p * units // num_pools * align, num_rows) for p in range(num_pools + 1)]
    return np.array(bounds, np.int64)


def parse_cpu_list(text: str) -> list[int]:
    """The sysfs cpulist format: `0-3,8,10-11` -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def numa_node_cpus(root: Path = NODE_ROOT) -> list[list[int]]:
    """CPUs of each NUMA node that this process may use, nodes without such CPUs left out."""
    allowed = os.sched_getaffinity(0)
    nodes = sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:]))
    cpus = [sorted(allowed.intersection(parse_cpu_list((n / "cpulist").read_text())))
            for n in nodes]
    return [c for c in cpus if c]


def pool_cpus(num_pools: int, nodes: list[list[int]] | None = None) -> list[list[int]] | None:
    """CPUs per pool: the NUMA nodes in K equal groups of consecutive nodes; None (leave the
    threads unbound) when there is one pool or the nodes do not group evenly into K pools."""
    nodes = numa_node_cpus() if nodes is None else nodes
    if num_pools == 1 or not nodes or len(nodes) % num_pools:
        return None
    per_pool = len(nodes) // num_pools
    return [sorted(c for node in nodes[p * per_pool:(p + 1) * per_pool] for c in node)
            for p in range(num_pools)]


def cpu_masks(cpus_per_pool: list[list[int]] | None) -> np.ndarray:
    """[K, words] uint64 `cpu_set_t` bit masks for sched_setaffinity; [0, words] when None."""
    if cpus_per_pool is None:
        return np.zeros((0, _MIN_MASK_WORDS), np.uint64)
    top = max(c for cpus in cpus_per_pool for c in cpus)
    masks = np.zeros((len(cpus_per_pool), max(_MIN_MASK_WORDS, top // 64 + 1)), np.uint64)
    for p, cpus in enumerate(cpus_per_pool):
        for c in cpus:
            masks[p, c // 64] |= np.uint64(1) << np.uint64(c % 64)
    return masks


def format_cpus(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def describe_pinning(num_pools: int, cpus_per_pool: list[list[int]] | None) -> str:
    """One phrase for the start-up log: where the pools run."""
    if cpus_per_pool is not None:
        return "pinned to CPUs " + " | ".join(format_cpus(c) for c in cpus_per_pool)
    if num_pools == 1:
        return "threads not pinned"
    return f"threads not pinned ({len(numa_node_cpus())} NUMA node(s) do not group into " \
        f"{num_pools} pools)"


@contextmanager
def keeping_thread_affinity(is_active: bool) -> Iterator[None]:
    """Restore the calling thread's CPU affinity on exit: the kernels pin every worker to its
    pool, and worker 0 is the calling thread itself (OpenMP's master)."""
    if not is_active:
        yield
        return
    saved = os.sched_getaffinity(0)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)
