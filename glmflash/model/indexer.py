"""DSA k-pool indexer of a "full" MLA layer (spec/model.md §4.3-4.5)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.indexer import (
    SelectPlan,
    decode_select_plan,
    indexer_select,
    indexer_write,
    indexer_write_decode,
    select_plan,
    write_plan,
)
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.layers import Linear, stacked_parameters
from glmflash.model.state import ModelState
from glmflash.model.verify import verify_indexer_write

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
        key, gates, head_weights = nn.functional.linear(x, self.stack_weights()).split(
            [self.head_dim, self.head_dim, self.num_heads], dim=-1)
        keys = self.k_norm(key)
        self.write(keys, gates, batch, state)
        q = self.wq_b(q_latent).view(x.shape[0], self.num_heads, self.head_dim)
        selects = batch.cached("indexer_select", lambda: self.select_plan(batch, x.device))
        # The head weights' fp32 cast and 1/sqrt(H) scale happen in the scoring kernel.
        return indexer_select(q, head_weights, state.pool_keys[self.layer_idx], batch.page_table,
                              selects, page_size=batch.page_size, topk=self.topk,
                              kpool=self.kpool, select_tail=self.select_tail,
                              weight_scale=self.num_heads ** -0.5,
                              fp8_queries=state.fp8_index_queries)

    def stack_weights(self) -> torch.Tensor:
        """The weights of the three products of x (key, pool gate, head weights), stacked so
        that one product gives all three (built once)."""
        return stacked_parameters((self.wk.weight, self.index_kpool_compress_gate,
                                   self.weights_proj.weight))

    def write(self, keys: torch.Tensor, gates: torch.Tensor, batch: ForwardBatch,
              state: ModelState) -> None:
        """Fold this forward's keys into the pooled keys and the tails."""
        tail, pool_keys = state.index_tail[self.layer_idx], state.pool_keys[self.layer_idx]
        ape = self.index_kpool_compress_ape
        if batch.verify is not None:
            verify_indexer_write(keys, gates, ape, pool_keys, tail, batch.page_table,
                                 batch, self.layer_idx, page_size=batch.page_size)
            return
        if batch.decode is not None:
            indexer_write_decode(keys, gates, ape, pool_keys, tail, batch.page_table,
                                 batch.decode.state_slots, batch.decode.positions,
                                 page_size=batch.page_size)
            return
        writes = batch.cached("indexer_write", lambda: write_plan(
            batch.cu_seqlens, batch.prefix_lens, batch.state_slots, tail.shape[0], self.kpool,
            keys.device))
        indexer_write(keys, gates, ape, pool_keys, tail, batch.page_table, writes,
                      page_size=batch.page_size)

    def select_plan(self, batch: ForwardBatch, device: torch.device) -> SelectPlan:
        if batch.decode is not None:
            return decode_select_plan(batch.decode.state_slots, batch.decode.positions,
                                      self.kpool, batch.decode.max_pools)
        return select_plan(batch.cu_seqlens, batch.prefix_lens, batch.state_slots, self.kpool,
                           device)
