"""Which of the two exact e4m3 decodes the CPU experts use (README.md, "Derivation", on
denormals and the fp16 decode).

The fp32-bits decode has the fewest operations but turns e4m3 subnormals into fp32 denormals,
which Intel cores handle with a microcode assist per FMA; AMD Zen has no such penalty. The fp16
decode never makes a denormal. On Intel, weights holding enough subnormal codes take fp16.
"""

from __future__ import annotations

import platform
from pathlib import Path

import numpy as np
import torch

from glmflash.kernels.cpu_moe.llvm_ir import DECODE_FP16, DECODE_FP32_BITS
from glmflash.utils.env import cpu_moe_decode

DECODES = {"fp32-bits": DECODE_FP32_BITS, "fp16": DECODE_FP16}


# Share of subnormal codes from which Intel cores take the fp16 decode: an assist hits every
# 16-lane FMA holding a denormal, 1 - (1 - p)^16 of them, ~0.3% of FMAs at 2e-4, where its cost
# starts to exceed the fp16 decode's extra operations (figures in README.md, "Derivation").
SUBNORMAL_FP16_SHARE = 2e-4
SUBNORMAL_SAMPLE = 1 << 22


def subnormal_share(*weights: torch.Tensor) -> float:
    """Share of subnormal e4m3 codes (exponent 0, mantissa not 0) in evenly spaced samples of at
    most SUBNORMAL_SAMPLE bytes per weight."""
    hits = total = 0
    for weight in weights:
        flat = weight.reshape(-1).view(torch.uint8)
        # NOTE: an odd step walks every column of power-of-two-wide rows, not a few of them.
        step = max(1, flat.numel() // SUBNORMAL_SAMPLE) | 1
        sample = flat[::step][:SUBNORMAL_SAMPLE].numpy()
        hits += int(np.count_nonzero(((sample & 0x78) == 0) & ((sample & 0x07) != 0)))
        total += sample.size
    return hits / max(total, 1)


def is_intel() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return "intel" in platform.processor().lower()


def default_decode(*weights: torch.Tensor) -> str:
    """GLMFLASH_CPU_MOE_DECODE if set; else "fp16" on Intel when the weights hold at least
    SUBNORMAL_FP16_SHARE subnormal codes (their fp32 denormals take microcode assists there),
    and "fp32-bits" otherwise - the fewer operations."""
    chosen = cpu_moe_decode()
    if chosen:
        return chosen
    if is_intel() and (not weights or subnormal_share(*weights) >= SUBNORMAL_FP16_SHARE):
        return "fp16"
    return "fp32-bits"
