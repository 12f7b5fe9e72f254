"""The DSA indexer's training signal: its top-k choice carries no gradient, so it learns to
predict where its MLA layer's attention goes (the DeepSeek-V3.2 indexer objective). For each
query, the target is the attention mass of dense causal MLA attention (heads averaged) per
complete pool; the loss is KL(target || softmax of the indexer's pool scores) over the pools it
may choose. The MLA input is detached: this loss trains the indexer only.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from glmflash.kernels.indexer import compress_pools
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.mla import MultiLatentAttention
from glmflash.utils.device import upload
from tools.tiny_train_ops import Padded


class MlaInputs:
    """Records the input of every MLA layer with an indexer during a forward."""

    def __init__(self, *modules: nn.Module) -> None:
        self.records: list[tuple[MultiLatentAttention, torch.Tensor, ForwardBatch]] = []
        self.handles = [m.register_forward_pre_hook(self._record)
                        for module in modules for m in module.modules()
                        if isinstance(m, MultiLatentAttention) and m.indexer is not None]

    def _record(self, module, args) -> None:
        x, batch = args[0], args[1]
        self.records.append((module, x.detach(), batch))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def indexer_loss(records: list[tuple[MultiLatentAttention, torch.Tensor, ForwardBatch]],
                 counted: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
    """`counted`: per forward batch (by `id`), `[T]` 1 on the samples' tokens, 0 on padding
    (whose queries are left out); None: every token counts."""
    counted = counted or {}
    return torch.stack([_layer_loss(m, x, batch, counted.get(id(batch)))
                        for m, x, batch in records]).mean()


def _layer_loss(mla: MultiLatentAttention, x: torch.Tensor, batch: ForwardBatch,
                counted: torch.Tensor | None = None):
    """The mean over sequences (with a complete pool) of the mean KL over their queries that
    have a candidate pool (0 without any) and count; all sequences at once, padded to the
    longest."""
    idx, kpool = mla.indexer, mla.indexer.kpool
    layout = Padded(batch.cu_seqlens, x.device, kpool)
    with torch.no_grad():
        q_latent = mla.q_a_layernorm(mla.q_a_proj(x))
        q = mla.q_b_proj(q_latent).view(x.shape[0], mla.num_heads, mla.qk_dim)
        w_kv = mla.kv_b_proj.weight.view(mla.num_heads, mla.qk_dim + mla.v_dim, mla.kv_rank)
        q_abs = torch.einsum("thd,hdr->thr", q, w_kv[:, : mla.qk_dim])
        latent = mla.kv_a_layernorm(mla.kv_a_proj_with_mqa(x))
        target = _pool_mass(layout.pad(q_abs), layout.pad(latent), mla.qk_dim ** -0.5, kpool)
    num_seqs, length = layout.num_seqs, layout.length
    num_pools = length // kpool
    keys = layout.pad(idx.k_norm(idx.wk(x))).view(num_seqs, num_pools, kpool, -1)
    gates = layout.pad(nn.functional.linear(x, idx.index_kpool_compress_gate))
    pooled = compress_pools(keys.flatten(0, 1), gates.view(keys.shape).flatten(0, 1),
                            idx.index_kpool_compress_ape).view(num_seqs, num_pools, -1)
    q_idx = layout.pad(idx.wq_b(q_latent).view(x.shape[0], idx.num_heads, idx.head_dim))
    weights = layout.pad(idx.weights_proj(x).float() * idx.num_heads ** -0.5)
    scores = torch.relu(torch.einsum("blhd,bpd->blhp", q_idx, pooled) * idx.head_dim ** -0.5)
    scores = torch.einsum("blh,blhp->blp", weights, scores)
    pool_end = torch.arange(1, num_pools + 1, device=x.device) * kpool - 1
    candidate = pool_end[None, :] <= torch.arange(length, device=x.device)[:, None]  # [L, P]
    lens = upload(np.diff(batch.cu_seqlens), x.device)
    rows = candidate.any(-1)[None, :] & (torch.arange(length, device=x.device) < lens[:, None])
    if counted is not None:
        rows = rows & (layout.pad(counted) > 0)
    target = target.masked_fill(~candidate, 0)
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-9)
    log_p = torch.log_softmax(scores.masked_fill(~candidate, -1e9), dim=-1)
    kl = (target * (torch.log(target.clamp(min=1e-9)) - log_p)).masked_fill(~candidate, 0).sum(-1)
    num_rows = rows.sum(-1)
    per_seq = (kl * rows).sum(-1) / num_rows.clamp(min=1)
    has_pool = (num_rows > 0).float()
    return (per_seq * has_pool).sum() / has_pool.sum().clamp(min=1)


def _pool_mass(q_abs: torch.Tensor, latent: torch.Tensor, scale: float, kpool: int
               ) -> torch.Tensor:
    """Dense causal attention `[B, L, L]` (heads averaged) summed per complete pool
    `[B, L, L / kpool]`; q_abs `[B, L, h, r]`, latent `[B, L, r]`."""
    length = latent.shape[1]
    scores = torch.einsum("blhr,bsr->bhls", q_abs, latent) * scale
    causal = torch.ones(length, length, dtype=torch.bool, device=latent.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(1)
    return probs.view(*probs.shape[:2], length // kpool, kpool).sum(-1)
