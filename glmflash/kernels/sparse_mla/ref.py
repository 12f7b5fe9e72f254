"""Absorbed-latent sparse MLA attention over selected cache slots (spec/model.md §4.2).

Queries are already absorbed through the key half of kv_b_proj, so every head attends over the
single 512-wide latent: scores = q_lat . c_kv * scale; the output stays in latent space and the
caller applies the value half of kv_b_proj.
"""

from __future__ import annotations

import torch

QUERY_BLOCK = 256


def sparse_mla_ref(q_lat: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor, *,
                   scale: float) -> torch.Tensor:
    """q_lat `[T, H, R]`, latent cache `[N, R]`, slots `[T, W]` (-1 = none) -> `[T, H, R]`.

    Softmax in fp32 over the selected slots only; a query with no slot gets zeros.
    """
    out = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for t0 in range(0, q_lat.shape[0], QUERY_BLOCK):
        blk = slice(t0, t0 + QUERY_BLOCK)
        sel = slots[blk]
        # index_select: under autograd (training) its gradient is an atomic scatter-add.
        kv = latent.index_select(0, sel.clamp(min=0).flatten()).view(*sel.shape, latent.shape[-1])
        kv = kv.float()
        scores = torch.einsum("thr,twr->thw", q_lat[blk].float(), kv) * scale
        scores = scores.masked_fill((sel < 0)[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[blk] = torch.einsum("thw,twr->thr", probs, kv)
    return out.to(q_lat.dtype)
