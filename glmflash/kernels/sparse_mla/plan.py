"""Launch shapes, the split of the selected slots, and the workspace of the Triton sparse MLA.

Pure Python and torch (no Triton), so the model can size a workspace before any launch. README.md
says how the split is chosen, why the defaults are what they are, and where the merge runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

LOG2E = 1.4426950408889634
"""log2(e): the launchers fold it into the softmax scale, so the kernels' softmax runs in
log2 units (exp2)."""
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
    """How the sparse MLA launcher shapes its launches (README.md, "Defaults").

    The rule: a launch is split over the selected slots when fewer programs than `waves` per SM
    would run unsplit (decode), into as many splits as fill that wave, each of at least
    `min_split_steps` whole steps; the splits' partial outputs are kept in `partial_dtype` and
    merged by the combine kernel. Shapes are tried in order; the first that compiles for the
    device (shared memory) is kept per device and problem shape."""

    prefill: tuple[SparseMlaLaunch, ...] = (
        SparseMlaLaunch(64, 3, tail_slots=16), SparseMlaLaunch(64, 2, tail_slots=16),
        SparseMlaLaunch(32, 2, tail_slots=16), SparseMlaLaunch(16, 2))
    """Shapes when every program attends a query's whole selection (enough queries)."""
    decode: tuple[SparseMlaLaunch, ...] = (
        SparseMlaLaunch(64, 2, tail_slots=16), SparseMlaLaunch(32, 2, tail_slots=16),
        SparseMlaLaunch(16, 2))
    """Shapes when the selection is split over several programs per query."""
    waves: float = 1.0
    """Programs per SM that splitting the selection aims for."""
    min_split_steps: int = 1
    """Whole `block_slots` steps each split gets at least (bounds the splits of short
    selections and of one query)."""
    partial_dtype: torch.dtype | None = None
    """dtype of the splits' partial outputs in the workspace (None: the output's dtype, so a
    bf16 launch rounds each split's output to bf16 once more and the combine reads half the
    bytes; the log-sum-exps stay fp32)."""
    combine_heads: int = 16
    """Heads per program of the combine kernel."""
    combine_elements: int = 4096
    """Partial elements (splits x heads x columns) a combine program loads: the columns per
    program follow from this budget."""

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("prefill and decode need at least one launch shape each")
        if self.waves <= 0 or self.min_split_steps < 1:
            raise ValueError("waves must be positive and min_split_steps >= 1")

    def partials(self, out_dtype: torch.dtype) -> torch.dtype:
        """dtype of the workspace's partial outputs for launches that return `out_dtype`."""
        return self.partial_dtype or out_dtype


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


def head_blocks(num_queries: int, heads: int) -> int:
    """Programs per split: queries x blocks of 64 heads."""
    return num_queries * -(-heads // head_block(heads))


def wanted_splits(num_queries: int, heads: int, num_sms: int, config: SparseMlaConfig) -> int:
    """Whether the selection is split at all: the splits that would fill `config.waves`
    programs per SM (1: enough queries to run unsplit)."""
    return max(1, int(num_sms * config.waves) // max(head_blocks(num_queries, heads), 1))


def split_plan(num_queries: int, heads: int, width: int, block_slots: int, num_sms: int,
               config: SparseMlaConfig, max_splits: int | None = None) -> SplitPlan:
    """The split of a `width`-slot selection for launches of `block_slots` slots per step:
    enough splits to fill `config.waves` programs per SM, each of at least `min_split_steps`
    whole steps, at most `max_splits` (what a workspace holds)."""
    full_steps = width // block_slots
    splits = min(wanted_splits(num_queries, heads, num_sms, config),
                 full_steps // config.min_split_steps)
    if max_splits is not None:
        splits = min(splits, max_splits)
    splits = max(1, splits)
    return SplitPlan(splits, full_steps // splits, full_steps % splits, full_steps)


def new_output(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The output of a launch on these inputs, once the kernels' layout rules are checked:
    q_lat `[T, H, R]`, latent `[N, R]` and slots `[T, W]` (int32 or int64) each contiguous
    along their last dimension."""
    num_queries, heads, rank = q_lat.shape
    assert latent.shape[1] == rank and slots.shape[0] == num_queries
    assert q_lat.stride(2) == 1 and latent.stride(1) == 1 and slots.stride(1) == 1
    assert slots.dtype in (torch.int32, torch.int64), slots.dtype
    return torch.empty(num_queries, heads, rank, dtype=q_lat.dtype, device=q_lat.device)


@dataclass(frozen=True)
class SparseMlaWorkspace:
    """Per-split results of a split launch, reusable by every launch of one forward (they run in
    stream order). Bounded by the programs of one wave, not by the context."""

    partial_out: torch.Tensor
    """`[rows, H, R]` in `config.partials(out dtype)`: each split's output, normalised by its
    own softmax sum."""
    partial_lse: torch.Tensor
    """`[rows, H]` fp32: each split's log2-sum-exp2 of its scaled scores (-inf: no slot)."""

    @classmethod
    def create(cls, num_queries: int, heads: int, rank: int, width: int, device: torch.device,
               num_sms: int, config: SparseMlaConfig = DEFAULT_CONFIG,
               out_dtype: torch.dtype = torch.bfloat16) -> SparseMlaWorkspace:
        smallest = min(shape.block_slots for shape in config.decode)
        splits = split_plan(num_queries, heads, width, smallest, num_sms, config).num_splits
        rows = num_queries * splits if splits > 1 else 0
        return cls(torch.empty(rows, heads, rank, dtype=config.partials(out_dtype),
                               device=device),
                   torch.empty(rows, heads, dtype=torch.float32, device=device))

    def max_splits(self, num_queries: int, heads: int, rank: int) -> int:
        """Splits per query this workspace holds for a launch of that shape."""
        assert self.partial_out.shape[1:] == (heads, rank), (
            f"workspace for {tuple(self.partial_out.shape[1:])}, launch of ({heads}, {rank})")
        return self.partial_out.shape[0] // num_queries
