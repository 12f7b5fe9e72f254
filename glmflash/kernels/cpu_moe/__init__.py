"""Routed experts on CPU: `create_cpu_experts(...)` picks numba (default) or ref.

`GLMFLASH_KERNEL_CPU_MOE=ref|numba` overrides the choice. `NumbaMoeExperts` is imported lazily,
so `import glmflash` works without numba.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from glmflash.kernels.cpu_moe.ref import routed_experts_ref
from glmflash.utils.env import kernel_override

if TYPE_CHECKING:
    from glmflash.kernels.cpu_moe.numba_impl import NumbaMoeExperts

IMPLS = ("numba", "ref")


class RefMoeExperts:
    """`routed_experts_ref` behind the same `forward` interface as `NumbaMoeExperts`."""

    def __init__(self, gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor,
                 up_s: torch.Tensor, down_w: torch.Tensor, down_s: torch.Tensor, *,
                 swiglu_limit: float, block: int = 128):
        self.weights = (gate_w, gate_s, up_w, up_s, down_w, down_s)
        self.swiglu_limit = swiglu_limit
        self.block = block

    @property
    def weight_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The FP8 weights read (gate, up, down): the arguments themselves."""
        return self.weights[0], self.weights[2], self.weights[4]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                out: torch.Tensor | None = None) -> torch.Tensor:
        result = routed_experts_ref(x, topk_ids, topk_weights, *self.weights,
                                    swiglu_limit=self.swiglu_limit, block=self.block)
        return result if out is None else out.copy_(result)

    def warmup(self) -> None:
        """Nothing to compile."""


def create_cpu_experts(gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor,
                       up_s: torch.Tensor, down_w: torch.Tensor, down_s: torch.Tensor, *,
                       swiglu_limit: float, block: int = 128, impl: str | None = None,
                       **kwargs: Any) -> NumbaMoeExperts | RefMoeExperts:
    """Build the CPU expert runner; `impl` (or the env override) is "numba" or "ref";
    `block` is the weights' FP8 scale block (the checkpoint's `weight_block_size`).

    Extra keyword arguments (`num_threads`, `num_pools`) go to `NumbaMoeExperts`; with several
    pools its `weight_tensors` are new copies that the caller should hold instead of the inputs.
    """
    impl = impl or kernel_override("cpu_moe") or "numba"
    if impl not in IMPLS:
        raise ValueError(f"unknown cpu_moe impl {impl!r}; expected one of {IMPLS}")
    weights = (gate_w, gate_s, up_w, up_s, down_w, down_s)
    if impl == "ref":
        return RefMoeExperts(*weights, swiglu_limit=swiglu_limit, block=block)
    from glmflash.kernels.cpu_moe.numba_impl import NumbaMoeExperts
    return NumbaMoeExperts(*weights, swiglu_limit=swiglu_limit, block=block, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "NumbaMoeExperts":
        from glmflash.kernels.cpu_moe.numba_impl import NumbaMoeExperts
        return NumbaMoeExperts
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["NumbaMoeExperts", "RefMoeExperts", "create_cpu_experts", "routed_experts_ref"]
