"""The release stores most weights in FP8 (128x128 block scales): what that rounding costs a
trained tiny model, and training that sees it.

`quantization_gap` measures the losses of a fixed batch with the trained fp32 weights and with
the same weights rounded to FP8 and back (what the shipped checkpoint holds). `fake_fp8` rounds
those weights in every forward while the gradient passes straight through to the fp32 weights
(quantisation-aware training), for the last part of a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from glmflash.config import ModelConfig
from glmflash.kernels.fp8_gemm import FP8_DTYPE, dequantize_block_fp8, quantize_block_fp8
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.mtp import GlmMtp

PARAMETRIZED = ".parametrizations.weight.original"  # a parametrized weight's state-dict name


def fp8_weight_names(config: ModelConfig, module_class: type) -> set[str]:
    """Parameter names of `module_class` that the release stores in FP8 (stacked experts as
    one name)."""
    with torch.device("meta"):
        module = module_class(config, torch.bfloat16)
    return {name for name, p in module.named_parameters() if p.dtype == FP8_DTYPE}


def fp8_roundtrip(weight: torch.Tensor, block: int) -> torch.Tensor:
    """`weight` rounded to FP8 with block scales and back to its dtype."""
    q, scale_inv = quantize_block_fp8(weight, block=block)
    return dequantize_block_fp8(q, scale_inv, block=block, dtype=weight.dtype)


def _fp8_parameters(config: ModelConfig, model: GlmForCausalLM, mtp: GlmMtp
                    ) -> list[tuple[nn.Module, str]]:
    """(owning module, attribute) of every parameter that is FP8 in the release."""
    found = []
    for module, cls in ((model, GlmForCausalLM), (mtp, GlmMtp)):
        for name in fp8_weight_names(config, cls):
            owner, _, attr = name.rpartition(".")
            found.append((module.get_submodule(owner), attr))
    return found


class _FakeFp8(nn.Module):
    def __init__(self, block: int) -> None:
        super().__init__()
        self.block = block

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        rounded = fp8_roundtrip(weight.detach(), self.block)
        return weight + (rounded - weight.detach())


@contextlib.contextmanager
def fake_fp8(config: ModelConfig, model: GlmForCausalLM, mtp: GlmMtp) -> Iterator[None]:
    """Round the release's FP8 weights in every forward (straight-through gradient); the
    parameters stay the same objects (the optimizer keeps its state)."""
    block = config.quant.weight_block_size[0]
    owners = _fp8_parameters(config, model, mtp)
    for owner, attr in owners:
        parametrize.register_parametrization(owner, attr, _FakeFp8(block))
    try:
        yield
    finally:
        for owner, attr in owners:
            parametrize.remove_parametrizations(owner, attr, leave_parametrized=False)


@torch.no_grad()
def quantization_gap(config: ModelConfig, model: GlmForCausalLM, mtp: GlmMtp, losses_of
                     ) -> dict:
    """`losses_of()` (main, MTP) with the fp32 weights and with them rounded to FP8."""
    plain = [float(x) for x in losses_of()[:2]]
    block = config.quant.weight_block_size[0]
    saved = []
    for owner, attr in _fp8_parameters(config, model, mtp):
        param = getattr(owner, attr)
        saved.append((param, param.data.clone()))
        param.data.copy_(fp8_roundtrip(param.data, block))
    try:
        rounded = [float(x) for x in losses_of()[:2]]
    finally:
        for param, value in saved:
            param.data.copy_(value)
    return dict(loss_fp32=round(plain[0], 4), loss_fp8=round(rounded[0], 4),
                mtp_loss_fp32=round(plain[1], 4), mtp_loss_fp8=round(rounded[1], 4))
