"""One rank's network: built from its local config on the meta device, the routed experts
replaced by this rank's part, FP8 scale grids fitted to the shards, then materialised and wrapped
with an all-reduce after every token mixer and every FFN (applied from outside, as gpt-fast does).

Which dimension of which tensor is split is not listed by name: it is the dimension where the
rank's parameter differs from the same parameter of the full model (both built on meta).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.distributed.parallel import (
    MOE_EP,
    MOE_RANK0,
    ParallelConfig,
    expert_range,
    local_config,
    shard_block,
)
from glmflash.kernels.fp8_gemm import block_scale_shape
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.layers import Linear
from glmflash.model.moe import Experts, MoE, StackedWeight

AllReduce = Callable[[torch.Tensor], None]


@dataclass
class ShardPlan:
    """Where each parameter of this rank comes from in the checkpoint."""

    parallel: ParallelConfig
    split_dims: dict[str, int] = field(default_factory=dict)
    """Parameter -> the split dimension of its checkpoint tensor (per expert for stacked ones)."""
    scale_grids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """`weight_scale_inv` parameter -> (checkpoint block, local block, row offset, column
    offset, local scale rows, local scale columns): the shard's weight starts at that row and
    column of the full weight."""
    experts: tuple[int, int] = (0, 0)
    """(first, count) of the routed experts held here."""


class ExpertShard(Experts):
    """Experts first..first+count-1 of every MoE layer (expert parallel). Routing ids of other
    ranks' experts are set to -1 (skipped), so this rank returns the sum over its own experts."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, fp8_block: int | None,
                 first: int, count: int) -> None:
        super().__init__(config, dtype, fp8_block)
        d, i = config.hidden_size, config.moe_intermediate_size
        self.gate_proj = StackedWeight(count, i, d, dtype, fp8_block)
        self.up_proj = StackedWeight(count, i, d, dtype, fp8_block)
        self.down_proj = StackedWeight(count, d, i, dtype, fp8_block)
        self.first, self.count = first, count

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              rows: bool = False) -> object:
        local = ids - self.first
        local = torch.where((local >= 0) & (local < self.count), local, -1)
        return super().start(x, local, weights, rows)


class NoExperts(nn.Module):
    """A rank without routed experts (they run on rank 0): it adds zeros to the all-reduce."""

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              rows: bool = False) -> torch.Tensor:
        return torch.zeros_like(x)

    def finish(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def build_rank_model(config: ModelConfig, parallel: ParallelConfig, dtype: torch.dtype,
                     device: torch.device | str) -> tuple[GlmForCausalLM, ShardPlan]:
    """This rank's network (uninitialised, on `device`) and where its weights come from."""
    with torch.device("meta"):
        full = GlmForCausalLM(config, dtype)
        model = GlmForCausalLM(local_config(config, parallel), dtype)
        plan = ShardPlan(parallel, experts=expert_range(config, parallel))
        _place_experts(model, config, parallel, plan, dtype)
        full_shapes = {name: tuple(p.shape) for name, p in full.named_parameters()}
        _fit_scale_grids(model, full_shapes, plan)
    plan.split_dims = _split_dims(model, full_shapes, parallel.tp_size)
    model.to_empty(device=device)
    return model, plan


def install_all_reduce(model: GlmForCausalLM, all_reduce: AllReduce) -> None:
    """Sum the partial outputs of every mixer and FFN over the ranks (two per layer)."""
    def reduce_output(module: nn.Module, args: tuple, output):
        all_reduce(output[0] if isinstance(output, tuple) else output)
        return output

    for layer in model.text.layers:
        layer.self_attn.register_forward_hook(reduce_output)
        layer.mlp.register_forward_hook(reduce_output)
        if isinstance(layer.mlp, MoE):
            layer.mlp.sum_in_consumer = False  # the hook must see the routed + shared sum


def _place_experts(model: GlmForCausalLM, config: ModelConfig, parallel: ParallelConfig,
                   plan: ShardPlan, dtype: torch.dtype) -> None:
    fp8_block = config.quant.weight_block_size[0] if config.quant else None
    first, count = plan.experts
    for module in model.modules():
        if not isinstance(module, MoE):
            continue
        if parallel.moe_mode == MOE_EP:
            module.experts = ExpertShard(config, dtype, fp8_block, first, count)
        elif parallel.moe_mode == MOE_RANK0:
            # Rank 0 holds every expert at full width (hybrid placement runs there).
            module.experts = Experts(config, dtype, fp8_block) if count else NoExperts()


def _fit_scale_grids(model: nn.Module, full_shapes: dict[str, tuple[int, ...]],
                     plan: ShardPlan) -> None:
    """Give each split FP8 weight the scale block its shard can keep, and note its offsets."""
    rank = plan.parallel.rank
    for prefix, module in model.named_modules():
        if not isinstance(module, Linear | StackedWeight) or not module.fp8_block:
            continue
        local = tuple(module.weight.shape[-2:])
        full = full_shapes[f"{prefix}.weight"][-2:]
        block = module.fp8_block
        sub = min(shard_block(f, n, block) for f, n in zip(full, local, strict=True))
        if sub != block:
            if isinstance(module, StackedWeight):
                raise ValueError(f"{prefix}: a routed-expert shard of {local} (of {full}) does "
                                 f"not start on a {block}-block edge; choose another tp_size "
                                 "or expert parallelism")
            module.fp8_block = sub
            module.weight_scale_inv = nn.Parameter(
                torch.empty(block_scale_shape(local, sub), dtype=torch.float32),
                requires_grad=False)
        offsets = [rank * n if f != n else 0 for f, n in zip(full, local, strict=True)]
        plan.scale_grids[f"{prefix}.weight_scale_inv"] = (block, sub, *offsets,
                                                          *block_scale_shape(local, sub))


def _split_dims(model: nn.Module, full_shapes: dict[str, tuple[int, ...]], tp: int
                ) -> dict[str, int]:
    splits = {}
    for name, param in model.named_parameters():
        if name.endswith("weight_scale_inv"):
            continue
        stacked = ".mlp.experts." in name
        full, local = full_shapes[name], tuple(param.shape)
        # The expert dimension of stacked weights is placed by expert id, not sliced.
        skip = 1 if stacked else 0
        dims = [d for d in range(skip, len(local)) if full[d] != local[d]]
        if not dims:
            continue
        assert len(dims) == 1 and full[dims[0]] == local[dims[0]] * tp, (name, full, local)
        splits[name] = dims[0] - skip
    return splits
