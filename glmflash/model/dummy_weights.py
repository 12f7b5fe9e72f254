"""Random weights in memory for `load_format="dummy"`: a model that runs at release shapes with
no checkpoint (benchmarks, smoke runs). Deterministic for a seed; nothing is read or written.

One block of normal values is drawn once per device; every parameter is filled with windows of
it at varying offsets (copies at memory speed, so tens of GB take seconds, on the device where the
parameter lives), then shaped by the rule for its name.
"""

from __future__ import annotations

import logging
import math
import random
import time

import torch
from torch import nn

from glmflash.kernels.fp8_gemm.ref import FP8_DTYPE, FP8_MAX

logger = logging.getLogger(__name__)

POOL_NUMEL = 1 << 24
"""Normal values drawn per device (64 MiB of fp32, 16 MiB of e4m3 codes); a row of a filled
tensor is a window of at most half of them."""
WEIGHT_STD = 0.02
# A checkpoint's 128x128 block scale is its amax / 448, and the amax of 16K Gaussian values is
# about 4.25 sigma: codes then spread with sigma ~105, ~1e-4 of them subnormal, none NaN.
CODE_STD = 448 / 4.25
FP8_SCALE = WEIGHT_STD / CODE_STD
"""Typical `weight_scale_inv` (~1.9e-4): dequantised FP8 weights have WEIGHT_STD too."""
HC_SCALE = 0.1
"""mHC `scale`: keeps the pre/post gates near sigmoid's middle and the mixing near uniform."""


class _Pool:
    """Normals and e4m3 codes drawn once on one device; `fill` copies windows of them."""

    def __init__(self, device: torch.device, seed: int) -> None:
        generator = torch.Generator(device=device).manual_seed(seed)
        self.normal = torch.randn(POOL_NUMEL, generator=generator, device=device)
        # NOTE: clamped to the largest finite e4m3 (448 = 0x7e), so no NaN code (0x7f/0xff).
        codes = (self.normal * CODE_STD).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        self.codes = codes.view(torch.uint8)

    def fill(self, flat: torch.Tensor, source: torch.Tensor, rng: random.Random) -> None:
        """Copy into `flat` rows of `source`, each shifted by `stride` from the last (one copy
        for the whole tensor, whatever its size), plus a tail from a random offset."""
        window = min(flat.numel(), POOL_NUMEL // 2)
        rows, tail = divmod(flat.numel(), window)
        room = POOL_NUMEL - window
        stride = room // rows
        offset = rng.randrange(room - (rows - 1) * stride + 1)
        shifted = source.as_strided((rows, window), (stride, 1), offset)
        flat[:rows * window].view(rows, window).copy_(shifted)
        if tail:
            offset = rng.randrange(POOL_NUMEL - tail + 1)
            flat[rows * window:].copy_(source[offset:offset + tail])


@torch.no_grad()
def fill_dummy_weights(model: nn.Module, *, seed: int = 0) -> None:
    """Give every parameter of `model` deterministic random values that keep activations O(1).

    bf16/fp32 weights ~N(0, 0.02); norm weights 1; biases 0; FP8 weights are e4m3 codes spread as
    a checkpoint's with block scales near FP8_SCALE; KDA, router and mHC parameters as in
    `_shape_values`.
    """
    start = time.perf_counter()
    pools: dict[torch.device, _Pool] = {}
    rng = random.Random(seed)
    num_bytes = 0
    for name, param in model.named_parameters():
        data = param.data
        assert data.is_contiguous(), f"{name} is not contiguous"
        pool = pools.get(data.device)
        if pool is None:
            pool = pools[data.device] = _Pool(data.device, seed)
        if data.dtype == FP8_DTYPE:
            pool.fill(data.view(torch.uint8).view(-1), pool.codes, rng)
        else:
            pool.fill(data.view(-1), pool.normal, rng)
            _shape_values(name, data)
        num_bytes += data.numel() * data.element_size()
    logger.info("dummy weights: %.2f GB of random values in %.1f s (seed %d)", num_bytes / 1e9,
                time.perf_counter() - start, seed)


def _shape_values(name: str, data: torch.Tensor) -> None:
    """Turn standard normals into the values the parameter `name` needs (in place)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "weight_scale_inv":
        # Positive, log-normal around FP8_SCALE (a factor ~1.2 either way).
        data.mul_(0.25).exp2_().mul_(FP8_SCALE)
    elif leaf == "A_log":
        # Decay rates exp(A_log) spread over [1, 16] across heads, as the reference initialises.
        data.copy_(torch.linspace(0.0, math.log(16.0), data.numel()))
    elif leaf == "e_score_correction_bias":
        data.mul_(0.01)
    elif leaf == "bias" or (leaf.startswith("hc_") and leaf.endswith("_base")):
        data.zero_()
    elif leaf.startswith("hc_") and leaf.endswith("_scale"):
        data.fill_(HC_SCALE)
    elif data.ndim == 1 and "norm" in name:
        data.fill_(1.0)
    elif "conv1d" in name:
        # A depthwise kernel of a few taps: unit gain.
        data.mul_(data.shape[-1] ** -0.5)
    else:
        data.mul_(WEIGHT_STD)
