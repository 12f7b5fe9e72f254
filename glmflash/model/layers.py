"""Building blocks: RMSNorm, (block-FP8) Linear, clamped SwiGLU MLP (spec/model.md §2.4, §5.1)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.kernels.fp8_gemm import (
    FP8_DTYPE,
    block_scale_shape,
    dequantize_block_fp8,
    fp8_linear,
    fp8_linear_on_triton,
)
from glmflash.kernels.rms_norm import rms_norm
from glmflash.kernels.swiglu import clamped_swiglu_ref as clamped_swiglu
from glmflash.kernels.swiglu import clamped_swiglu_stacked
from glmflash.utils.derived import kept

# FP8 weights up to this many elements keep a dequantised copy when their product runs the
# reference (tiny models on the CPU); release weights are far larger and never do.
DEQUANTIZED_CACHE_LIMIT = 1 << 20


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def as_pair(self) -> tuple[torch.Tensor, float]:
        """(weight, eps), for a kernel that applies this norm to what it produces."""
        return self.weight, self.eps


class Linear(nn.Module):
    """`y = x W^T (+ b)`; with `fp8_block` the weight is FP8 e4m3 plus `weight_scale_inv`."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, *,
                 bias: bool = False, fp8_block: int | None = None) -> None:
        super().__init__()
        self.fp8_block = fp8_block
        weight_dtype = FP8_DTYPE if fp8_block else dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=weight_dtype),
                                   requires_grad=False)
        if fp8_block:
            scale_shape = block_scale_shape((out_features, in_features), fp8_block)
            self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32),
                                                 requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_block:
            y = nn.functional.linear(x, self.weight)
        elif fp8_linear_on_triton(x) or self.weight.numel() > DEQUANTIZED_CACHE_LIMIT:
            y = fp8_linear(x, self.weight, self.weight_scale_inv, block=self.fp8_block)
        else:
            # The reference product of a small weight (tiny models, on the CPU): the same
            # dequantised copy every call, kept instead of made again.
            y = nn.functional.linear(x, self.dequantized(x.dtype))
        return y if self.bias is None else y + self.bias

    def of_swiglu(self, gate_up: torch.Tensor, limit: float) -> torch.Tensor:
        """This projection of the clamped SwiGLU of `gate_up` (`[..., 2 * in]`, gate then up):
        on the Triton FP8 path the activation is formed as the product reads its input (no
        launch of its own), elsewhere applied first."""
        if self.fp8_block and self.bias is None and fp8_linear_on_triton(gate_up):
            return fp8_linear(gate_up, self.weight, self.weight_scale_inv, block=self.fp8_block,
                              swiglu_limit=limit)
        return self(clamped_swiglu_stacked(gate_up, limit))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The FP8 weight dequantised to `dtype`, kept while the weight and scales stay."""
        key = (self.weight.data_ptr(), self.weight_scale_inv.data_ptr(), dtype,
               self.weight.device)
        return kept(self, "dequantized", key, lambda: dequantize_block_fp8(
            self.weight, self.weight_scale_inv, block=self.fp8_block, dtype=dtype))


class MLP(nn.Module):
    """SwiGLU with the GLM clamp: dense layers, the shared expert, the vision MLPs (biased).
    Without biases the gate and up projections run as one product over their stacked weights
    (`stacked_linear`) and the activation as one op over it, or inside the down projection's
    product (`Linear.of_swiglu`)."""

    def __init__(self, hidden: int, width: int, limit: float, dtype: torch.dtype,
                 fp8_block: int | None, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, width, dtype, bias=bias, fp8_block=fp8_block)
        self.up_proj = Linear(hidden, width, dtype, bias=bias, fp8_block=fp8_block)
        self.down_proj = Linear(width, hidden, dtype, bias=bias, fp8_block=fp8_block)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.stack_weights()
        if gate_up is None:
            return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))
        return self.down_proj.of_swiglu(gate_up(x), self.limit)

    def stack_weights(self) -> Linear | None:
        """The gate and up projections' stacked Linear (built once; None where they do not
        stack)."""
        pair = (self.gate_proj, self.up_proj)
        return stacked_linear(pair) if can_stack(pair) else None


def stack_weights(model: nn.Module) -> None:
    """Build every module's stacked weights now, after loading and placing, rather than in the
    first forward: the separate tensors are given back before the memory plan measures, and the
    stacked ones are not made under inference mode (modules with a `stack_weights` method)."""
    for module in model.modules():
        if module is not model and hasattr(module, "stack_weights"):
            module.stack_weights()


def can_stack(projections: tuple[Linear, ...]) -> bool:
    """Linears that `stacked_linear` can join: no biases, one input width and weight kind, FP8
    row counts on whole scale blocks, and no gradient wanted (a stacked copy would cut it)."""
    first = projections[0]
    if first.weight.requires_grad and torch.is_grad_enabled():
        return False
    return all(p.bias is None and p.fp8_block == first.fp8_block
               and p.weight.dtype == first.weight.dtype
               and p.weight.shape[1] == first.weight.shape[1]
               and (not p.fp8_block or p.weight.shape[0] % p.fp8_block == 0)
               for p in projections)


def stacked_linear(projections: tuple[Linear, ...]) -> Linear:
    """One Linear over the stacked weights (and FP8 scales) of `projections`, whose outputs
    are its columns in order. Built once: the parameters become views of the stacked tensors
    (one copy in memory), and it is rebuilt if a parameter is moved or replaced."""
    first = projections[0]
    held = first.__dict__.get("_stacked_linear")
    if held is not None and held[0] == _storage_key(tuple(p.weight for p in projections)):
        return held[1]
    rows, cols = sum(p.weight.shape[0] for p in projections), first.weight.shape[1]
    with torch.device("meta"):  # its parameters take the stacked tensors below
        joined = Linear(cols, rows, first.weight.dtype, fp8_block=first.fp8_block)
    for name in ("weight", "weight_scale_inv") if first.fp8_block else ("weight",):
        stacked = stacked_parameters(tuple(getattr(p, name) for p in projections))
        setattr(joined, name, nn.Parameter(stacked, requires_grad=False))
    # Kept outside the module tree: not a submodule, no second state-dict entry.
    first.__dict__["_stacked_linear"] = (_storage_key(tuple(p.weight for p in projections)),
                                         joined)
    return joined


def fused_weight(projections: tuple[nn.Module, ...]) -> torch.Tensor:
    """The weights of plain `Linear`s that read the same input, stacked `[sum N, K]`, so one
    product replaces several launches (`stacked_parameters`)."""
    assert all(p.bias is None and not p.fp8_block for p in projections)
    return stacked_parameters(tuple(p.weight for p in projections))


def stacked_parameters(params: tuple[nn.Parameter, ...]) -> torch.Tensor:
    """Parameters of one row width stacked `[sum N, K]`. Built once: the parameters become
    views of the stacked tensor (one copy in memory), and it is rebuilt if one of them is moved
    or replaced. While training, a plain copy (a stacked parameter would cut the gradient)."""
    first = params[0]
    if first.requires_grad and torch.is_grad_enabled():
        return torch.cat(params)
    held = getattr(first, "_stacked", None)
    if held is not None and held[0] == _storage_key(params):
        return held[1]
    stacked = torch.cat([p.data for p in params])
    offset = 0
    for p in params:
        rows = p.shape[0]
        p.data = stacked[offset: offset + rows]
        offset += rows
    first._stacked = (_storage_key(params), stacked)
    return stacked


def _storage_key(params: tuple[torch.Tensor, ...]) -> tuple:
    return tuple((p.data_ptr(), p.device) for p in params)
