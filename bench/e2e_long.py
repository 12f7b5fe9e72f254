"""Long-context reporting of bench/e2e.py (`--long-context`): the engine's memory ledger, the
peak GPU memory torch allocated against the ledger's prediction, and decode at the longest
context against the shortest."""

from __future__ import annotations

import torch

from glmflash.engine.memory_ledger import GIB, GPU

# Ledger rows torch's allocator holds (the CUDA context, other processes, the allocator's own
# cache and the margin are not allocations).
ALLOCATED_ROWS = ("weights and buffers", "activations and workspaces", "CUDA graphs",
                  "KDA state slots", "prefix-cache snapshots", "MLA pages")


def predicted_peak(ledger) -> int:
    """Bytes the ledger says torch may allocate at most (no prompt log-probabilities asked)."""
    return sum(max(r.nbytes, r.measured or 0) for r in ledger.rows
               if r.where == GPU and r.name in ALLOCATED_ROWS)


def reset_peak() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def memory_line(engine, label: str) -> str:
    """Peak allocated since `reset_peak` against the ledger's prediction."""
    ledger = engine.memory_ledger
    peak = torch.cuda.max_memory_allocated()
    predicted = predicted_peak(ledger)
    return (f"memory {label}: peak allocated {peak / GIB:.3f} GiB, ledger {predicted / GIB:.3f} "
            f"GiB ({100 * (peak - predicted) / predicted:+.2f}%)")


def decode_ratio_line(rows: list[dict]) -> str:
    """Decode tok/s at the longest context over the shortest, per mode at the smallest batch."""
    parts = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        ones = [r for r in rows if r["mode"] == mode and r["batch"] == min(x["batch"]
                                                                            for x in rows)]
        short, long = min(ones, key=lambda r: r["context"]), max(ones, key=lambda r: r["context"])
        parts.append(f"{mode}: decode at {long['context']} = {long['tok_s']:.1f} tok/s, "
                     f"{100 * long['tok_s'] / short['tok_s']:.0f}% of {short['tok_s']:.1f} at "
                     f"{short['context']}")
    return "; ".join(parts)
