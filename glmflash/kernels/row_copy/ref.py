"""`copy_rows` in torch ops (the CPU path and the spec of the Triton kernel)."""

from __future__ import annotations

import torch


def copy_rows_ref(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
                  dst_rows: torch.Tensor) -> None:
    """`copy_rows` in torch ops: rows skipped by a negative source keep what they held."""
    keep = (src_rows >= 0).view(-1, *[1] * (src.dim() - 1))
    dst[dst_rows] = torch.where(keep, src[src_rows.clamp(min=0)], dst[dst_rows])
