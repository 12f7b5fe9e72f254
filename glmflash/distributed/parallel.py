"""How the model is split over ranks (DESIGN.md "Several GPUs"; spec/serving.md §4).

Every rank builds the network from its *local* config: the KDA and MLA heads, the dense MLP and
the shared expert's width divided by `tp_size`, so the model files stay unaware of ranks and the
per-rank cache (KDA state by head) follows from the same config. Replicated: embeddings, lm_head,
mHC, norms, the low-rank projections, the DSA indexer, the router. The routed experts are split
one of three ways:

* `tp`: every expert's intermediate width divided (`ep_size == 1`);
* `ep`: the experts divided among ranks, each computing the tokens routed to its own
  (`ep_size == tp_size`);
* `rank0`: all routed experts on rank 0 (the hybrid CPU-expert placement, computed once per step),
  the other ranks adding zeros to the FFN all-reduce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from math import gcd

from glmflash.config import ModelConfig
from glmflash.utils.validation import require

MOE_TP, MOE_EP, MOE_RANK0 = "tp", "ep", "rank0"
# The smallest FP8 scale block a shard may be re-gridded to (a Triton tile dimension).
MIN_SUB_BLOCK = 16


@dataclass(frozen=True)
class ParallelConfig:
    tp_size: int = 1
    """Ranks (processes, one per GPU); attention heads and FFN widths are divided by it."""
    ep_size: int = 1
    """1: tensor parallel inside the routed experts; `tp_size`: experts divided among ranks."""
    rank: int = 0
    experts_on_rank0: bool = False
    """Routed experts only on rank 0 (hybrid CPU experts: computed once, not once per rank)."""

    def __post_init__(self) -> None:
        require([
            (self.tp_size >= 1, "tp_size must be >= 1"),
            (self.ep_size in (1, self.tp_size),
             f"ep_size ({self.ep_size}) must be 1 (tensor-parallel experts) or tp_size "
             f"({self.tp_size}, experts divided among ranks)"),
            (0 <= self.rank < self.tp_size, f"rank {self.rank} is outside 0..{self.tp_size - 1}"),
        ])

    @property
    def moe_mode(self) -> str:
        if self.experts_on_rank0:
            return MOE_RANK0
        return MOE_EP if self.ep_size > 1 else MOE_TP

    def for_rank(self, rank: int) -> ParallelConfig:
        return dataclasses.replace(self, rank=rank)


def check_divisible(config: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse a split the model's shapes do not allow, naming the dimension."""
    tp = parallel.tp_size
    dims = {"linear_attn_config.num_heads (KDA heads)": config.linear_num_heads,
            "num_attention_heads (MLA heads)": config.num_attention_heads,
            "intermediate_size": config.intermediate_size,
            "moe_intermediate_size": config.moe_intermediate_size}
    require([(value % tp == 0, f"{name} = {value} is not divisible by tp_size {tp}")
             for name, value in dims.items()])
    if parallel.moe_mode == MOE_EP:
        require([(config.n_routed_experts % parallel.ep_size == 0,
                  f"n_routed_experts = {config.n_routed_experts} is not divisible by ep_size "
                  f"{parallel.ep_size}")])
    require([(not config.attention_bias or tp == 1,
              "attention_bias with tp_size > 1 is not supported (the row-parallel o_proj "
              "bias would be added once per rank)")])


def local_config(config: ModelConfig, parallel: ParallelConfig) -> ModelConfig:
    """The config one rank builds its network from: heads and FFN widths divided by tp_size."""
    check_divisible(config, parallel)
    tp = parallel.tp_size
    return dataclasses.replace(
        config, linear_num_heads=config.linear_num_heads // tp,
        num_attention_heads=config.num_attention_heads // tp,
        num_key_value_heads=config.num_key_value_heads // tp,
        intermediate_size=config.intermediate_size // tp,
        moe_intermediate_size=config.moe_intermediate_size // tp)


def expert_range(config: ModelConfig, parallel: ParallelConfig) -> tuple[int, int]:
    """(first, count) of the routed experts held by this rank."""
    e = config.n_routed_experts
    if parallel.moe_mode == MOE_EP:
        count = e // parallel.ep_size
        return parallel.rank * count, count
    if parallel.moe_mode == MOE_RANK0:
        return 0, e if parallel.rank == 0 else 0
    return 0, e


def shard_block(full: int, local: int, block: int) -> int:
    """The FP8 scale block a shard of `local` rows (of `full`) can keep exactly.

    `block` when every shard starts on a block edge or the dimension is one block; otherwise a
    divisor of `block` that every shard offset is a multiple of (the scales are re-gridded).
    """
    if local == full or local % block == 0 or full <= block:
        return block
    sub = gcd(block, local)
    if sub < MIN_SUB_BLOCK:
        raise ValueError(f"a shard of {local} of {full} rows cannot keep FP8 scales of block "
                         f"{block}: use a tp_size that divides the dimension into multiples of "
                         f"{MIN_SUB_BLOCK}")
    return sub
