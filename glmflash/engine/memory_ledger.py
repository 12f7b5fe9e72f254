"""The start-up memory ledger: where every large allocation of the engine lives, and what is left.

Rows are planned (the cache, from the plan), measured (weights, the CUDA context, and after
start the warm-up's peak and the graphs) or estimated from the sizes (engine/workspace.py).
The engine logs the table at start and refuses to start with it, and the flags to change, when
the plan cannot fit (`MemoryPlanError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20
GPU, PINNED, HOST = "GPU", "pinned host", "host"
# GPU rows whose bytes torch's caching allocator holds (graph pools included); the CUDA context,
# other processes and the planning margin are outside it, and prompt-logprob logits are held only
# while a request asks for them.
ALLOCATOR_ROWS = ("weights and buffers", "allocator cache", "activations and workspaces",
                  "CUDA graphs", "KDA state slots", "prefix-cache snapshots", "MLA pages")


class MemoryPlanError(ValueError):
    """The requested context, batch and chunk do not fit; the message holds the ledger."""


@dataclass(slots=True)
class LedgerRow:
    name: str
    where: str
    """GPU, pinned host or (pageable) host memory."""
    nbytes: int
    how: str
    """"measured", "estimated" or "planned"."""
    note: str = ""
    measured: int | None = None
    """After start: what the engine measured for an estimated row (warm-up, graph capture)."""


@dataclass
class MemoryLedger:
    device: str
    capacity: int
    """Bytes of the device the cache lives on (GPU: its total; CPU: host memory available)."""
    rows: list[LedgerRow] = field(default_factory=list)

    def add(self, name: str, where: str, nbytes: int, how: str, note: str = "") -> None:
        self.rows.append(LedgerRow(name, where, int(nbytes), how, note))

    def row(self, name: str) -> LedgerRow:
        return next(r for r in self.rows if r.name == name)

    def record(self, name: str, nbytes: int) -> None:
        """A measured value for an estimated row. The totals keep the larger of the two: the
        start-up measurement runs at a short context, where the indexer's tiles are narrower."""
        self.row(name).measured = int(nbytes)

    def used(self, where: str | None = None) -> int:
        """Bytes of the rows at `where` (default: the cache's device)."""
        where = where or self.cache_where
        return sum(max(r.nbytes, r.measured or 0) for r in self.rows if r.where == where)

    def expected_reserved(self, as_planned: bool = False) -> int:
        """Bytes torch's allocator is expected to hold on the GPU while serving (no prompt
        log-probabilities asked): each row it holds at its measured value where the engine
        measured one (warm-up, graph capture), else as planned or estimated: the ledger's
        prediction after start. `as_planned`: the larger of the two, as `used` counts them."""
        return sum(max(r.nbytes, r.measured or 0) if as_planned
                   else r.nbytes if r.measured is None else r.measured
                   for r in self.rows if r.where == GPU and r.name in ALLOCATOR_ROWS)

    @property
    def cache_where(self) -> str:
        return GPU if self.device.startswith("cuda") else HOST

    @property
    def left(self) -> int:
        return self.capacity - self.used()

    def table(self) -> str:
        """The ledger as an aligned text table (GiB), with what is left on the device."""
        lines = [f"memory ledger on {self.device} ({self.capacity / GIB:.2f} GiB):",
                 f"  {'item':<34} {'where':<11} {'GiB':>9}  {'how':<10} note"]
        for r in self.rows:
            value = f"{r.nbytes / GIB:9.3f}"
            how = r.how
            if r.measured is not None:
                value, how = f"{r.measured / GIB:9.3f}", f"measured (estimate {r.nbytes / GIB:.3f})"
            lines.append(f"  {r.name:<34} {r.where:<11} {value}  {how:<10} {r.note}".rstrip())
        lines.append(f"  {'left':<34} {self.cache_where:<11} {self.left / GIB:9.3f}")
        return "\n".join(lines)


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB"


def human(nbytes: float) -> str:
    """GiB, MiB or KiB, whichever reads best."""
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes / 1024:.1f} KiB"
