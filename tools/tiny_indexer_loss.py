"""The DSA indexer's training signal: its top-k choice carries no gradient, so it learns to
predict where its MLA layer's attention goes (the DeepSeek-V3.2 indexer objective). For each
query, the target is the attention mass of dense causal MLA attention (heads averaged) per
complete pool; the loss is KL(target || softmax of the indexer's pool scores) over the pools it
may choose. The MLA input is detached: this loss trains the indexer only.
"""

from __future__ import annotations

import torch
from torch import nn

from glmflash.kernels.indexer import compress_pools
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.mla import MultiLatentAttention


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


def indexer_loss(records: list[tuple[MultiLatentAttention, torch.Tensor, ForwardBatch]]
                 ) -> torch.Tensor:
    losses = [_layer_loss(m, x, batch) for m, x, batch in records]
    losses = [loss for loss in losses if loss is not None]
    return torch.stack(losses).mean() if losses else torch.zeros(())


def _layer_loss(mla: MultiLatentAttention, x: torch.Tensor, batch: ForwardBatch):
    idx, kpool = mla.indexer, mla.indexer.kpool
    with torch.no_grad():
        q_latent = mla.q_a_layernorm(mla.q_a_proj(x))
        q = mla.q_b_proj(q_latent).view(x.shape[0], mla.num_heads, mla.qk_dim)
        w_kv = mla.kv_b_proj.weight.view(mla.num_heads, mla.qk_dim + mla.v_dim, mla.kv_rank)
        q_abs = torch.einsum("thd,hdr->thr", q, w_kv[:, : mla.qk_dim])
        latent = mla.kv_a_layernorm(mla.kv_a_proj_with_mqa(x))
    keys = idx.k_norm(idx.wk(x))
    gates = nn.functional.linear(x, idx.index_kpool_compress_gate)
    q_idx = idx.wq_b(q_latent).view(x.shape[0], idx.num_heads, idx.head_dim)
    weights = idx.weights_proj(x).float() * idx.num_heads ** -0.5
    losses = []
    for a, e in zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True):
        n = e - a
        num_pools = n // kpool
        if num_pools == 0:
            continue
        with torch.no_grad():
            target = _pool_mass(q_abs[a:e], latent[a:e], mla.qk_dim ** -0.5, num_pools, kpool)
        pooled = compress_pools(keys[a:a + num_pools * kpool].view(num_pools, kpool, -1),
                                gates[a:a + num_pools * kpool].view(num_pools, kpool, -1),
                                idx.index_kpool_compress_ape)
        scores = torch.relu(torch.einsum("thd,pd->thp", q_idx[a:e], pooled)
                            * idx.head_dim ** -0.5)
        scores = torch.einsum("th,thp->tp", weights[a:e], scores)
        pool_end = torch.arange(1, num_pools + 1) * kpool - 1
        candidate = pool_end[None, :] <= torch.arange(n)[:, None]
        rows = candidate.any(-1)
        target = target.masked_fill(~candidate, 0)[rows]
        target = target / target.sum(-1, keepdim=True).clamp(min=1e-9)
        log_p = torch.log_softmax(scores.masked_fill(~candidate, -1e9)[rows], dim=-1)
        kl = (target * (torch.log(target.clamp(min=1e-9)) - log_p)).masked_fill(
            ~candidate[rows], 0).sum(-1)
        losses.append(kl.mean())
    return torch.stack(losses).mean() if losses else None


def _pool_mass(q_abs: torch.Tensor, latent: torch.Tensor, scale: float, num_pools: int,
               kpool: int) -> torch.Tensor:
    """Dense causal attention `[n, n]` (heads averaged) summed per complete pool `[n, P]`."""
    n = latent.shape[0]
    scores = torch.einsum("thr,sr->hts", q_abs, latent) * scale
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1).mean(0)
    return probs[:, : num_pools * kpool].view(n, num_pools, kpool).sum(-1)
