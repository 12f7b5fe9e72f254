"""Long-context reporting of bench/e2e.py (`--long-context`): the engine's memory ledger, the
peak GPU memory torch's allocator held against the ledger's prediction, and decode at the
longest context against the shortest."""

from __future__ import annotations

import torch

from glmflash.engine.memory_ledger import GIB


def reset_peak() -> None:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()


def memory_line(engine, label: str) -> str:
    """Peak reserved since `reset_peak` (what the allocator took from the device, CUDA-graph
    pools included: a replay allocates nothing, so peak *allocated* misses them) against the
    ledger's prediction after start, and against its start-up plan (estimates kept where larger).
    """
    ledger = engine.memory_ledger
    peak = torch.cuda.max_memory_reserved()
    predicted = ledger.expected_reserved()
    planned = ledger.expected_reserved(as_planned=True)
    return (f"memory {label}: peak reserved {peak / GIB:.3f} GiB, ledger after start "
            f"{predicted / GIB:.3f} GiB ({100 * (peak - predicted) / predicted:+.2f}%), start-up "
            f"plan {planned / GIB:.3f} GiB ({100 * (peak - planned) / planned:+.2f}%); peak "
            f"allocated {torch.cuda.max_memory_allocated() / GIB:.3f} GiB")


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
