"""Cache planning with a memory ledger: pages and state slots that fit beside the weights, the
activation workspaces and the CUDA graphs, or a refusal that says which flag to change.

GPU: weights plus cache stay within `mem_fraction_static` of the device (SGLang's meaning), and
the rest of the device must hold the workspaces of the largest chunk and batch, the graphs and
a margin; the cache is capped so that they do (logged). CPU: the cache takes at most
`cache_budget_gb`. Either way at least one sequence of `context_length` tokens must fit, with
`max_running_requests` state slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import NamedTuple

import torch

from glmflash.config import ModelConfig
from glmflash.engine.cache import CachePlan
from glmflash.engine.memory_ledger import (
    GIB,
    GPU,
    HOST,
    MIB,
    PINNED,
    MemoryLedger,
    MemoryPlanError,
    gib,
    human,
)
from glmflash.engine.options import EngineConfig
from glmflash.engine.workspace import forward_bytes, graph_bytes, logit_bytes
from glmflash.model.state import cache_bytes

logger = logging.getLogger(__name__)
# Kept free on a GPU for the allocator's rounding and fragmentation.
GPU_MARGIN = 512 * MIB


class DeviceMemory(NamedTuple):
    """A snapshot of a GPU's memory (bytes), taken after the weights are placed."""

    total: int
    free: int
    allocated: int
    """Held by torch's tensors (weights, resident experts, buffers)."""
    reserved: int
    """Held by torch's caching allocator (>= allocated)."""

    @classmethod
    def of(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total, free, torch.cuda.memory_allocated(device),
                   torch.cuda.memory_reserved(device))


SPEC_SCRATCH = "speculative verify scratch"


class CacheShape(NamedTuple):
    page_size: int
    per_token: int
    per_slot: int
    num_slots: int
    pages_per_seq: int

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.per_token


def plan_memory(model_config: ModelConfig, options: EngineConfig, max_seq_len: int,
                device: torch.device, dtype: torch.dtype, *, model: torch.nn.Module | None = None,
                graph_sizes: list[int] | tuple[int, ...] = (),
                memory: DeviceMemory | None = None) -> tuple[CachePlan, MemoryLedger]:
    """The cache plan and its ledger; raises MemoryPlanError (with the ledger) when the context
    length, running requests and chunk size cannot fit. The prefix cache's pool of KDA state
    snapshots (`options.num_state_snapshots`) is planned beside the slots.
    `memory`: the GPU's memory (default: measured now).
    """
    shape = _cache_shape(model_config, options, max_seq_len, dtype)
    num_snapshots = options.num_state_snapshots
    snapshot_bytes = num_snapshots * shape.per_slot
    on_gpu = device.type == "cuda"
    if on_gpu:
        memory = memory or DeviceMemory.of(device)
        ledger = MemoryLedger(str(device), memory.total)
    else:
        ledger = MemoryLedger(str(device), host_available())
    _weight_rows(ledger, model, memory)
    if not on_gpu:
        # Weights already loaded are not in MemAvailable any more.
        ledger.capacity += ledger.used(HOST)
    _workspace_rows(ledger, model_config, options, max_seq_len, shape, dtype, on_gpu,
                    graph_sizes)
    ledger.add("KDA state slots", ledger.cache_where, (shape.num_slots + 1) * shape.per_slot,
               "planned", f"{shape.num_slots} + 1 reserved x {human(shape.per_slot)}")
    ledger.add("prefix-cache snapshots", ledger.cache_where, snapshot_bytes, "planned",
               f"{num_snapshots} x {human(shape.per_slot)}" if num_snapshots else "off")
    num_steps = options.num_speculative_steps
    if num_steps:
        ledger.add(SPEC_SCRATCH, ledger.cache_where, shape.num_slots * num_steps * shape.per_slot,
                   "planned", f"{shape.num_slots} x {num_steps} drafts x {human(shape.per_slot)}")
    if on_gpu:
        ledger.add("margin", GPU, GPU_MARGIN, "planned", "allocator rounding")
    num_pages = _fit_pages(ledger, options, shape, memory)
    ledger.add("MLA pages", ledger.cache_where, (num_pages + 1) * shape.page_bytes, "planned",
               f"{num_pages} + 1 reserved x {shape.page_size} tokens "
               f"({shape.per_token} B/token): {num_pages * shape.page_size} tokens, "
               f"{num_pages / shape.pages_per_seq:.2f} sequences of {max_seq_len}")
    plan = CachePlan(num_pages=num_pages, page_size=shape.page_size,
                     num_state_slots=shape.num_slots, max_pages_per_seq=shape.pages_per_seq,
                     num_snapshots=num_snapshots,
                     fp8_index_keys=options.fp8_index_keys,
                     fp8_index_queries=options.fp8_index_queries)
    if num_pages < shape.pages_per_seq or ledger.left < 0:
        raise MemoryPlanError(refusal(ledger, options, shape, max_seq_len, on_gpu))
    logger.info("%s", ledger.table())
    return plan, ledger


def _cache_shape(config: ModelConfig, options: EngineConfig, max_seq_len: int,
                 dtype: torch.dtype) -> CacheShape:
    page = -(-options.page_size // config.index_kpool) * config.index_kpool
    per_token, per_slot = cache_bytes(config, dtype, options.fp8_index_keys)
    return CacheShape(page, per_token, per_slot, options.max_running_requests,
                      -(-max_seq_len // page))


def _weight_rows(ledger: MemoryLedger, model: torch.nn.Module | None,
                 memory: DeviceMemory | None) -> None:
    placed = weight_bytes(model) if model is not None else {}
    if memory is not None:
        params = placed.get(GPU)
        ledger.add("weights and buffers", GPU, memory.allocated, "measured",
                   "" if params is None else
                   f"parameters {gib(params)}, other tensors {gib(memory.allocated - params)}")
        ledger.add("CUDA context, other processes", GPU,
                   memory.total - memory.free - memory.reserved, "measured")
        ledger.add("allocator cache", GPU, memory.reserved - memory.allocated, "measured")
    for where in (PINNED, HOST):
        if placed.get(where) or (where == HOST and memory is None):
            ledger.add("weights", where, placed.get(where, 0), "measured")


def weight_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters and buffers by where they live (each storage once)."""
    seen, out = set(), {}
    check_pinned = torch.cuda.is_available()
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or tensor.device.type == "meta":
            continue
        seen.add(storage.data_ptr())
        where = GPU if tensor.is_cuda else \
            PINNED if check_pinned and tensor.is_pinned() else HOST
        out[where] = out.get(where, 0) + storage.nbytes()
    return out


def _workspace_rows(ledger: MemoryLedger, config: ModelConfig, options: EngineConfig,
                    max_seq_len: int, shape: CacheShape, dtype: torch.dtype, on_gpu: bool,
                    graph_sizes) -> None:
    from glmflash.engine.model_runner import selection_widths

    item = torch.empty(0, dtype=dtype).element_size()
    chunk = min(options.chunked_prefill_size, max_seq_len)
    batch = options.max_running_requests
    max_pools = shape.pages_per_seq * shape.page_size // config.index_kpool
    prefill = forward_bytes(config, chunk, min(batch, chunk), max_pools, item,
                            reference=not on_gpu)
    decode = forward_bytes(config, batch, batch, max_pools, item, reference=not on_gpu)
    ledger.add("activations and workspaces", ledger.cache_where, max(prefill, decode),
               "estimated", f"chunk of {chunk} tokens or {batch} decodes; nothing grows with "
               "context")
    ledger.add("prompt-logprob logits", ledger.cache_where, logit_bytes(config, chunk, item),
               "estimated", f"up to {chunk} rows x {config.vocab_size} (when a request asks)")
    if on_gpu and graph_sizes:
        widths = selection_widths(max_pools)
        ledger.add("CUDA graphs", GPU, graph_bytes(config, list(graph_sizes), widths, item),
                   "estimated", f"batch sizes {list(graph_sizes)} x {len(widths)} widths")


def _fit_pages(ledger: MemoryLedger, options: EngineConfig, shape: CacheShape,
               memory: DeviceMemory | None) -> int:
    """Pages within the budget and the room the other rows leave; at most what every running
    sequence at full length needs."""
    # NOTE: the budget covers the slots and pages sequences use; the runner's reserved slot and
    # page (padding rows) come on top, as the ledger's rows show.
    fixed = shape.num_slots * shape.per_slot + ledger.row("prefix-cache snapshots").nbytes + \
        sum(r.nbytes for r in ledger.rows if r.name == SPEC_SCRATCH)
    if memory is not None:
        budget = memory.total * options.mem_fraction_static - memory.allocated - fixed
    else:
        budget = options.cache_budget_gb * GIB - fixed
    by_budget = int(budget // shape.page_bytes)
    by_room = int(ledger.left // shape.page_bytes) - 1
    pages = max(0, min(by_budget, by_room, shape.num_slots * shape.pages_per_seq))
    if memory is not None and by_room < min(by_budget, shape.num_slots * shape.pages_per_seq):
        logger.warning("the cache is capped at %d pages (%s) so that the workspaces and graphs "
                       "fit: mem_fraction_static %.2f would give %d", max(by_room, 0),
                       gib(max(by_room, 0) * shape.page_bytes), options.mem_fraction_static,
                       by_budget)
    return pages


def refusal(ledger: MemoryLedger, options: EngineConfig, shape: CacheShape, max_seq_len: int,
            on_gpu: bool) -> str:
    """Why the plan does not fit, the ledger, and the flags that would make it fit."""
    need = shape.pages_per_seq * shape.page_bytes
    have = max(0, ledger.row("MLA pages").nbytes - shape.page_bytes)
    fits = max(0, have // shape.page_bytes * shape.page_size)
    budget_flag = "--mem-fraction-static" if on_gpu else "--cache-budget-gb"
    lines = [f"cannot start: one sequence of {max_seq_len} tokens needs {gib(need)} of MLA "
             f"pages beside {options.max_running_requests} KDA state slots, and "
             f"{gib(have)} fit" if ledger.left >= 0 else
             f"cannot start: the plan exceeds the device by {gib(-ledger.left)}",
             ledger.table(), "change one of:",
             f"  --context-length {fits} or less (what fits now)" if fits else
             "  --context-length (not even one page fits)",
             f"  --max-running-requests (each holds {shape.per_slot / MIB:.1f} MiB of KDA state)",
             f"  --chunked-prefill-size (workspaces of {options.chunked_prefill_size} tokens: "
             f"{gib(_chunk_bytes(ledger))})"]
    if on_gpu:
        lines.append("  --mem-fraction-static (weights + cache share of the device), or "
                     "--kt-num-gpu-experts / --cuda-graph-max-bs to free GPU memory")
    else:
        lines.append(f"  {budget_flag} (the cache's share of host memory)")
    return "\n".join(lines)


def _chunk_bytes(ledger: MemoryLedger) -> int:
    return sum(ledger.row(name).nbytes
               for name in ("activations and workspaces", "prompt-logprob logits"))


def host_available() -> int:
    """Host memory available to this process now (MemAvailable; total RAM elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextlib.contextmanager
def measured_peak(ledger: MemoryLedger | None, row: str, device: torch.device,
                  doing: str) -> Iterator[None]:
    """On a GPU: record for `row` the most bytes allocated above the level before the block (or,
    if more, what torch's allocator kept: a graph pool is reserved, not allocated, once its
    capture ends), and turn an out-of-memory error inside it into a MemoryPlanError carrying
    the ledger."""
    if ledger is None or device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        raise MemoryPlanError(f"cannot start: out of GPU memory while {doing}\n{ledger.table()}\n"
                              "lower --chunked-prefill-size, --cuda-graph-max-bs or "
                              "--mem-fraction-static") from exc
    ledger.record(row, max(torch.cuda.max_memory_allocated(device) - base,
                           torch.cuda.memory_reserved(device) - reserved))
    found = ledger.row(row)
    if found.measured > found.nbytes:
        logger.warning("%s took %s, more than the estimate of %s", doing,
                       gib(found.measured), gib(found.nbytes))
