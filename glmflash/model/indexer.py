"""DSA k-pool indexer of a "full" MLA layer (spec/model.md §4.3-4.5)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.indexer import indexer_select, indexer_write, select_plan, write_plan
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.layers import Linear
from glmflash.model.state import ModelState

INDEXER_NORM_EPS = 1e-6


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        heads, d, hidden = config.index_n_heads, config.index_head_dim, config.hidden_size
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, heads, d
        self.topk, self.kpool = config.index_topk, config.index_kpool
        self.select_tail = config.index_kpool_always_select_tail
        self.wq_b = Linear(config.q_lora_rank, heads * d, dtype)
        self.wk = Linear(hidden, d, dtype)
        self.k_norm = nn.LayerNorm(d, eps=INDEXER_NORM_EPS, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = Linear(hidden, heads, dtype)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(self.kpool, d, dtype=dtype),
                                                     requires_grad=False)
        self.index_kpool_compress_gate = nn.Parameter(torch.empty(d, hidden, dtype=dtype),
                                                      requires_grad=False)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, batch: ForwardBatch,
                state: ModelState) -> torch.Tensor:
        """Write this forward's keys into the pool cache.

        Returns the attended slots `[T, W]`.
        """
        keys = self.k_norm(self.wk(x))
        gates = nn.functional.linear(x, self.index_kpool_compress_gate)
        tail = state.index_tail[self.layer_idx]
        geometry = (batch.cu_seqlens, batch.prefix_lens, batch.state_slots)
        writes = batch.cached("indexer_write", lambda: write_plan(
            *geometry, tail.shape[0], self.kpool, x.device))
        indexer_write(keys, gates, self.index_kpool_compress_ape, state.pool_keys[self.layer_idx],
                      tail, batch.page_table, writes, page_size=batch.page_size)
        q = self.wq_b(q_latent).view(x.shape[0], self.num_heads, self.head_dim)
        weights = self.weights_proj(x).float() * self.num_heads ** -0.5
        selects = batch.cached("indexer_select", lambda: select_plan(
            *geometry, self.kpool, x.device))
        return indexer_select(q, weights, state.pool_keys[self.layer_idx], batch.page_table,
                              selects, page_size=batch.page_size, topk=self.topk,
                              kpool=self.kpool, select_tail=self.select_tail)
