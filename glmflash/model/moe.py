"""Routed experts with a shared expert (spec/model.md §5.2-5.3)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.fp8_gemm import FP8_DTYPE, block_scale_shape, dequantize_block_fp8
from glmflash.kernels.fused_moe import ExpertRows, fused_moe
from glmflash.kernels.router import RouterSpec, route, route_ref
from glmflash.model.layers import MLP, clamped_swiglu
from glmflash.utils.derived import kept


class Router(nn.Module):
    """Sigmoid scores; bias-corrected, group-limited top-k choice; renormalised, scaled weights."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(e, dtype=torch.float32),
                                                    requires_grad=False)
        self.top_k, self.num_groups, self.topk_groups = (config.num_experts_per_tok,
                                                         config.n_group, config.topk_group)
        self.renormalize, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.spec = RouterSpec(self.top_k, self.num_groups, self.topk_groups, self.renormalize,
                               self.scaling)
        self.counts: torch.Tensor | None = None
        """When set (a `[E]` tensor), every routing choice is counted into it."""

    def weight_fp32(self) -> torch.Tensor:
        """The router weight in fp32 (the reference scores in fp32), converted once."""
        return kept(self, "weight_fp32", self.weight.data_ptr(), self.weight.float)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert ids `[T, k]`, fp32 weights `[T, k]`). No host sync, except
        `bincount` while `counts` is set."""
        spec, bias = self.spec, self.e_score_correction_bias
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            ids, weights = route_ref(x, self.weight, bias, spec=spec)  # training: autograd
        else:
            ids, weights = route(x, self.weight, bias, spec=spec, weight_fp32=self.weight_fp32())
        if self.counts is not None:
            self.counts += torch.bincount(ids.flatten(), minlength=self.counts.numel())
        return ids, weights


class StackedWeight(nn.Module):
    """One projection of all experts: `[E, N, K]` (FP8 with `[E, N/b, K/b]` scales, or plain)."""

    def __init__(self, num_experts: int, n: int, k: int, dtype: torch.dtype,
                 fp8_block: int | None) -> None:
        super().__init__()
        self.fp8_block = fp8_block
        self.weight = nn.Parameter(torch.empty(num_experts, n, k,
                                               dtype=FP8_DTYPE if fp8_block else dtype),
                                   requires_grad=False)
        if fp8_block:
            self.weight_scale_inv = nn.Parameter(
                torch.empty(block_scale_shape((num_experts, n, k), fp8_block),
                            dtype=torch.float32), requires_grad=False)

    @property
    def scale(self) -> torch.Tensor | None:
        """The block scales (`weight_scale_inv`), or None for plain weights."""
        return self.weight_scale_inv if self.fp8_block else None

    def expert(self, e: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.fp8_block:
            return self.weight[e].to(dtype)
        return dequantize_block_fp8(self.weight[e], self.weight_scale_inv[e],
                                    block=self.fp8_block, dtype=dtype)


class Experts(nn.Module):
    """The routed experts. On the GPU the grouped kernel (kernels/fused_moe, no host sync); FP8
    experts on the CPU run on the CPU MoE kernel (numba, or its ref under
    GLMFLASH_KERNEL_CPU_MOE=ref); plain CPU experts a loop over the experts hit.

    `start` queues (or hands off) the work and `finish` returns the sum `[T, D]`, so that the
    caller can queue other work in between (the shared expert, while CPU experts run)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, fp8_block: int | None) -> None:
        super().__init__()
        e, d, i = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_proj = StackedWeight(e, i, d, dtype, fp8_block)
        self.up_proj = StackedWeight(e, i, d, dtype, fp8_block)
        self.down_proj = StackedWeight(e, d, i, dtype, fp8_block)
        self.limit = config.swiglu_limit
        self.cpu_kernel = None
        """The CPU kernel over these weights, once `build_cpu_kernel` has run."""
        self.backend = None
        """Where a placement transform put these experts (engine/experts.py `place_experts`:
        CPU + GPU hybrid); it offers the same `start` / `finish`."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.finish(self.start(x, ids, weights))

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
              rows: bool = False) -> object:
        """Begin the routed experts of `x` `[T, D]`; returns what `finish` takes. `rows`: the
        caller sums them itself where it can (the GPU experts' `ExpertRows`)."""
        if self.backend is not None:
            return self.backend.start(x, ids, weights)
        if x.device.type != "cpu":
            return grouped_experts(x, ids, weights, self.projections(), self.limit, rows)
        if self.gate_proj.fp8_block:
            return self.cpu_experts().forward(x, ids, weights).to(x.dtype)
        return self.loop_forward(x, ids, weights)

    def finish(self, pending: object) -> torch.Tensor | ExpertRows:
        """The routed experts' sum `[T, D]` begun by `start` (or their rows, see `start`)."""
        if self.backend is not None:
            return self.backend.finish(pending)
        return pending

    def projections(self) -> tuple[StackedWeight, StackedWeight, StackedWeight]:
        return self.gate_proj, self.up_proj, self.down_proj

    def cpu_experts(self):
        """The CPU kernel over these weights (built with default options on first use)."""
        return self.build_cpu_kernel()

    def build_cpu_kernel(self, num_threads: int | None = None, num_pools: int = 1):
        """Build the CPU kernel once: `num_threads` (default numba's) in `num_pools` thread
        pools (`--kt-threadpool-count`), each owning a slice of every expert's rows in memory
        local to its NUMA node; zero-copy with one pool. Later calls return the same kernel."""
        if self.cpu_kernel is None:
            from glmflash.kernels.cpu_moe import create_cpu_experts

            projections = self.projections()
            tensors = [t for p in projections for t in (p.weight.data, p.weight_scale_inv.data)]
            options = {"num_threads": num_threads} if num_threads else {}
            if num_pools > 1:
                options["num_pools"] = num_pools
            self.cpu_kernel = create_cpu_experts(*tensors, swiglu_limit=self.limit,
                                                 block=self.gate_proj.fp8_block, **options)
            # With pools the kernel copied each weight onto its pools' nodes: the parameters
            # take the copies, so the loaded originals are freed (one copy in RAM).
            for p, weight in zip(projections, self.cpu_kernel.weight_tensors, strict=True):
                p.weight.data = weight
        return self.cpu_kernel

    def loop_forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                     ) -> torch.Tensor:
        return experts_loop(x, ids, weights, self.projections(), self.limit)


def grouped_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    projections: tuple, limit: float, rows: bool = False
                    ) -> torch.Tensor | ExpertRows:
    """`fused_moe` over (gate, up, down) objects with `weight` `[E, N, K]`, `scale` (None:
    plain weights) and `fp8_block`; ids index their E experts, < 0 skip. `rows`: the rows
    before their sum where the Triton kernels run (`ExpertRows`)."""
    gate, up, down = projections
    return fused_moe(x, ids, weights, gate.weight, gate.scale, up.weight, up.scale, down.weight,
                     down.scale, limit=limit, block=gate.fp8_block or 128, rows=rows)


def experts_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 projections: tuple, limit: float) -> torch.Tensor:
    """Sum over the experts hit (ascending, as the reference) of weight * SwiGLU expert(x).

    `projections` are (gate, up, down) objects with `expert(e, dtype) -> [N, K]`; ids < 0 skip.
    """
    out = torch.zeros_like(x)
    gate, up, down = projections
    for e in ids.unique().tolist():
        if e < 0:
            continue
        token_idx, slot = torch.where(ids == e)
        h = x[token_idx]
        act = clamped_swiglu(h @ gate.expert(e, x.dtype).t(), h @ up.expert(e, x.dtype).t(), limit)
        y = act @ down.expert(e, x.dtype).t()
        out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(x.dtype))
    return out


class MoE(nn.Module):
    sum_in_consumer = True
    """The decoder layer takes `parts` and adds them in its hyper_post; False where the sum
    must come out of `forward` itself (a forward hook reads it: the tensor-parallel
    all-reduce)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, fp8_block: int | None) -> None:
        super().__init__()
        self.gate = Router(config, dtype)
        self.experts = Experts(config, dtype, fp8_block)
        width = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, width, config.swiglu_limit, dtype, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed, shared = self.parts(x)
        return routed + shared

    def parts(self, x: torch.Tensor, unsummed: bool = False
              ) -> tuple[torch.Tensor | ExpertRows, torch.Tensor]:
        """(routed experts' output, shared expert's output): `forward` is their sum, which a
        caller may fold into its next kernel (the decoder layer's hyper_post). `unsummed`: the
        GPU experts' rows may come before their sum (`ExpertRows`; hyper_post sums them)."""
        ids, weights = self.gate(x)
        # The routed experts start first: CPU experts (hybrid placement) are handed off as soon
        # as routing is known, and run while the GPU computes the shared expert.
        pending = self.experts.start(x, ids, weights, rows=unsummed)
        shared = self.shared_experts(x)
        return self.experts.finish(pending), shared
