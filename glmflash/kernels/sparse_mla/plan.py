"""Launch shapes, the split of the selected slots, and the workspace of the Triton sparse MLA.

Pure Python and torch (no Triton), so the model can size a workspace before any launch. README.md
says how the split is chosen and why the combine is where it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

HEAD_BLOCK = 64
"""Heads per program: the M dimension of both products."""
MIN_DOT = 16
"""Smallest dimension `tl.dot` takes."""


@dataclass(frozen=True)
class SparseMlaLaunch:
    """One launch shape of the attention kernel."""

    block_slots: int
    """Selected slots gathered and attended per step (the N of the score product)."""
    num_stages: int
    """Software pipeline depth of the slot loop: gathers run this many steps - 1 ahead."""
    num_warps: int = 8
    tail_slots: int | None = None
    """Slots per step past the last whole `block_slots` step (None: `block_slots`)."""
    split_scores: bool = True
    """Split the score product by columns between the warpgroups (README.md, "Scores")."""

    def __post_init__(self) -> None:
        tail = self.tail
        if self.block_slots < MIN_DOT or self.block_slots & (self.block_slots - 1):
            raise ValueError(f"block_slots {self.block_slots} must be a power of two >= 16")
        if tail < MIN_DOT or tail & (tail - 1) or tail > self.block_slots:
            raise ValueError(f"tail_slots {tail} must be a power of two in [16, block_slots]")

    @property
    def tail(self) -> int:
        return self.tail_slots or self.block_slots


@dataclass(frozen=True)
class SparseMlaConfig:
    """How the sparse MLA launcher shapes its launches. Shapes are tried in order; the first that
    compiles for the device (shared memory) is kept per device and problem shape."""

    prefill: tuple[SparseMlaLaunch, ...] = (SparseMlaLaunch(64, 3), SparseMlaLaunch(64, 2),
                                            SparseMlaLaunch(32, 2), SparseMlaLaunch(16, 2))
    """Shapes when every program attends a query's whole selection (enough queries)."""
    decode: tuple[SparseMlaLaunch, ...] = (SparseMlaLaunch(64, 2), SparseMlaLaunch(32, 2),
                                           SparseMlaLaunch(16, 2))
    """Shapes when the selection is split over several programs per query."""
    waves: float = 1.0
    """Programs per SM that splitting the selection aims for."""
    min_split_steps: int = 2
    """Whole `block_slots` steps each split gets at least."""
    max_splits: int = 64
    """Splits per query at most (fewer, longer splits: less for the combine to read)."""
    split_heads: int = HEAD_BLOCK
    """Heads per program of a split launch (a power of two >= 16; below 64 the products are
    not warpgroup-wide, but more programs share the work of few queries)."""
    value_halves: bool = False
    """Split launches: two programs per (query, head block, split), each accumulating one half
    of the latent columns (both compute the whole scores): twice the programs, half the
    accumulator and partial per program."""
    bf16_partials: bool = False
    """Workspace partial outputs in bf16 instead of fp32 (half the bytes the combine reads)."""
    max_fused_splits: int = 1
    """Up to this many splits the last split to finish combines them (arrival counter); above,
    a second kernel does, spread over the GPU (README.md)."""
    combine_heads: int = 16
    """Heads per program of the combine kernel."""
    combine_elements: int = 8192
    """Partial elements (splits x heads x columns) a combine step loads at once: every split
    of a tile is read in one round trip, the columns per step follow from this budget."""

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("prefill and decode need at least one launch shape each")
        if self.waves <= 0 or self.min_split_steps < 1 or self.max_fused_splits < 1 \
                or self.max_splits < 1:
            raise ValueError("waves must be positive, min_split_steps, max_splits and "
                             "max_fused_splits >= 1")
        if self.split_heads < MIN_DOT or self.split_heads & (self.split_heads - 1):
            raise ValueError(f"split_heads {self.split_heads} must be a power of two >= 16")

    @property
    def value_blocks(self) -> int:
        """Programs over the latent columns of a split launch."""
        return 2 if self.value_halves else 1


DEFAULT_CONFIG = SparseMlaConfig()


class SplitPlan(NamedTuple):
    """How one query's selection `[0, width)` is split over `num_splits` programs.

    The `full_steps` whole steps of `block_slots` slots are dealt out evenly: every split gets
    `steps_per_split`, the first `extra_steps` one more. The last split also attends the tail
    `[full_steps * block_slots, width)` in steps of the launch's tail width.
    """

    num_splits: int
    steps_per_split: int
    extra_steps: int
    full_steps: int


def head_block(heads: int, most: int = HEAD_BLOCK) -> int:
    """Heads per program: `most` (a power of two >= 16), or the power of two >= 16 that covers
    fewer heads."""
    return min(most, max(MIN_DOT, 1 << (heads - 1).bit_length()))


def split_counters(num_queries: int, heads: int, config: SparseMlaConfig) -> int:
    """Programs per split of a split launch: queries x head blocks x value blocks (also the
    arrival counters a fused combine needs)."""
    return num_queries * -(-heads // head_block(heads, config.split_heads)) * config.value_blocks


def wanted_splits(num_queries: int, heads: int, num_sms: int, config: SparseMlaConfig) -> int:
    """Whether the selection is split at all: the splits that would fill `config.waves`
    programs per SM with whole 64-head blocks (1: enough queries to run unsplit)."""
    programs = num_queries * -(-heads // head_block(heads))
    return max(1, int(num_sms * config.waves) // max(programs, 1))


def split_plan(num_queries: int, heads: int, width: int, block_slots: int, num_sms: int,
               config: SparseMlaConfig, max_splits: int | None = None) -> SplitPlan:
    """The split of a `width`-slot selection for launches of `block_slots` slots per step:
    enough splits to fill `config.waves` programs per SM (with the split launch's head and
    value blocks), each of at least `min_split_steps` whole steps, at most `max_splits`."""
    full_steps = width // block_slots
    fill = int(num_sms * config.waves) // max(split_counters(num_queries, heads, config), 1)
    splits = min(fill, full_steps // config.min_split_steps, config.max_splits)
    if max_splits is not None:
        splits = min(splits, max_splits)
    splits = max(1, splits)
    return SplitPlan(splits, full_steps // splits, full_steps % splits, full_steps)


@dataclass(frozen=True)
class SparseMlaWorkspace:
    """Per-split results of a split launch, reusable by every launch of one forward (they run in
    stream order). Bounded by the programs of one wave, not by the context."""

    partial_out: torch.Tensor
    """`[rows, H, R]` fp32 (or bf16): each split's output, normalised by its own softmax sum."""
    partial_lse: torch.Tensor
    """`[rows, H]` fp32: each split's log2-sum-exp2 of its scaled scores (-inf: no slot)."""
    arrivals: torch.Tensor
    """`[counters]` int32 zeros: finished splits per (query, head block, value block) of a
    fused combine.
    The last split resets its counter, so every launch leaves them at zero (CUDA-graph safe)."""

    @classmethod
    def create(cls, num_queries: int, heads: int, rank: int, width: int, device: torch.device,
               num_sms: int, config: SparseMlaConfig = DEFAULT_CONFIG) -> SparseMlaWorkspace:
        smallest = min(shape.block_slots for shape in config.decode)
        splits = split_plan(num_queries, heads, width, smallest, num_sms, config).num_splits
        rows = num_queries * splits if splits > 1 else 0
        dtype = torch.bfloat16 if config.bf16_partials else torch.float32
        return cls(torch.empty(rows, heads, rank, dtype=dtype, device=device),
                   torch.empty(rows, heads, dtype=torch.float32, device=device),
                   torch.zeros(split_counters(num_queries, heads, config), dtype=torch.int32,
                               device=device))

    def max_splits(self, num_queries: int, heads: int, rank: int,
                   config: SparseMlaConfig = DEFAULT_CONFIG) -> int:
        """Splits per query this workspace holds for a launch of that shape and config."""
        assert self.partial_out.shape[1:] == (heads, rank), (
            f"workspace for {tuple(self.partial_out.shape[1:])}, launch of ({heads}, {rank})")
        if self.arrivals.numel() < split_counters(num_queries, heads, config):
            return 1
        return self.partial_out.shape[0] // num_queries
