"""The two formats of the pooled-key cache: the model dtype (as the reference keeps it) or FP8.

FP8 (`--index-key-dtype fp8`, an opt-in): a row is the key's D e4m3 codes, then its fp32 scale
as four bytes and twelve zero bytes, in one uint8 tensor `[pools, D + 16]`: rows stay 16-byte
aligned, so programs load the codes in 16-byte vectors. scale = max(amax, 1e-12) / 448 and
code = key / scale rounded to nearest (DeepSeek's per-row activation quantiser, as the FP8
linears use it); the pooled key itself is first made in the model dtype exactly as the
reference makes it. Scoring then reads 144 bytes a key instead of 256. Since the scale is
positive, `relu(q . (code * scale)) = scale * relu(q . code)`, so kernels apply it once per key
after the sum over heads. A selection can differ from the reference's where pools score within
e4m3 rounding (3 mantissa bits) of each other; README.md has how much, and the speed.

A uint8 cache is the FP8 format; any float dtype is the model-dtype format.
"""

from __future__ import annotations

import torch

from glmflash.kernels.fp8_gemm.ref import FP8_DTYPE, FP8_MAX

TAIL_BYTES = 16
"""Bytes after the codes: the fp32 scale, then zeros to the next 16-byte boundary."""


def is_fp8(pool_keys: torch.Tensor) -> bool:
    return pool_keys.dtype == torch.uint8


def row_width(dim: int, fp8: bool) -> int:
    """Elements of one pooled key's row (bytes when FP8)."""
    if fp8:
        check_fp8_dim(dim)
    return dim + TAIL_BYTES if fp8 else dim


def check_fp8_dim(dim: int) -> None:
    """FP8 rows keep their codes and scale 16-byte aligned, so the key's width must be a
    multiple of 16."""
    if dim % 16:
        raise ValueError(f"FP8 pooled indexer keys need an index head dimension that is a "
                         f"multiple of 16 (this model's is {dim}): use --index-key-dtype auto")


def allocate(num_pools: int, dim: int, fp8: bool, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
    """A zeroed pooled-key cache of either format (a zero FP8 row dequantises to zeros)."""
    return torch.zeros(num_pools, row_width(dim, fp8), dtype=torch.uint8 if fp8 else dtype,
                       device=device)


def row_bytes(dim: int, fp8: bool, dtype: torch.dtype) -> int:
    return row_width(dim, fp8) if fp8 else dim * torch.empty(0, dtype=dtype).element_size()


def quantize(keys: torch.Tensor) -> torch.Tensor:
    """Keys `[..., D]` (any float dtype) -> FP8 rows `[..., D + 16]` uint8."""
    check_fp8_dim(keys.shape[-1])
    x = keys.float()
    if x.numel() == 0:  # (no pools: torch may give the empty scale a stride of 0)
        return torch.zeros(*x.shape[:-1], x.shape[-1] + TAIL_BYTES, dtype=torch.uint8,
                           device=x.device)
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    codes = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    pad = torch.zeros(*x.shape[:-1], TAIL_BYTES - 4, dtype=torch.uint8, device=x.device)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8), pad], dim=-1)


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows `[..., D]` -> (their e4m3 codes as fp32 `[..., D]`, scales `[...]`), each
    row quantised as `quantize` quantises a key: the FP8 scoring's queries (`fp8_queries`),
    whose products with the key codes the kernels take in e4m3."""
    rows = quantize(q)
    return split(rows)


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 rows `[..., D + 16]` -> (codes as fp32 `[..., D]`, scales `[...]`)."""
    dim = rows.shape[-1] - TAIL_BYTES
    codes = rows[..., :dim].contiguous().view(FP8_DTYPE).float()
    scales = rows[..., dim:dim + 4].contiguous().view(torch.float32)[..., 0]
    return codes, scales


def encode(pool_keys: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Keys `[..., D]` in the model dtype as rows of `pool_keys`' format."""
    return quantize(keys) if is_fp8(pool_keys) else keys.to(pool_keys.dtype)


def key_dim(pool_keys: torch.Tensor) -> int:
    return pool_keys.shape[-1] - (TAIL_BYTES if is_fp8(pool_keys) else 0)


__all__ = ["allocate", "check_fp8_dim", "encode", "is_fp8", "key_dim", "quantize",
           "quantize_queries", "row_bytes", "row_width", "split"]
