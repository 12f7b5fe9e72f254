"""MLA (NoPE) attention over the DSA indexer's selection, in absorbed-latent form (spec §4)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.sparse_mla import sparse_mla, sparse_mla_workspace
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.indexer import Indexer
from glmflash.model.layers import Linear, RMSNorm, can_stack, stacked_linear
from glmflash.model.state import ModelState


class MultiLatentAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 fp8_block: int | None) -> None:
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.layer_idx, self.num_heads = layer_idx, heads
        self.qk_dim, self.v_dim, self.kv_rank = (config.qk_head_dim, config.v_head_dim,
                                                 config.kv_lora_rank)
        bias = config.attention_bias
        self.q_a_proj = Linear(hidden, config.q_lora_rank, dtype, bias=bias, fp8_block=fp8_block)
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps, dtype)
        self.q_b_proj = Linear(config.q_lora_rank, heads * self.qk_dim, dtype, fp8_block=fp8_block)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_rank, dtype, bias=bias,
                                         fp8_block=fp8_block)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = Linear(self.kv_rank, heads * (self.qk_dim + self.v_dim), dtype)
        self.o_proj = Linear(heads * self.v_dim, hidden, dtype, bias=bias, fp8_block=fp8_block)
        self.indexer = Indexer(config, layer_idx, dtype) \
            if config.indexer_types[layer_idx] == "full" else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: ModelState,
                shared_selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the block output `[T, D]` and the selection `[T, W]`.

        The selection is passed on to a following layer that shares this layer's indexer.
        """
        num_tokens = x.shape[0]
        q_a, kv_a = self._down_projections(x)
        q_latent = self.q_a_layernorm(q_a)
        q = self.q_b_proj(q_latent).view(num_tokens, self.num_heads, self.qk_dim)
        latent_cache = state.latent[self.layer_idx]
        latent_cache[batch.token_slots] = self.kv_a_layernorm(kv_a).to(latent_cache.dtype)
        if self.indexer is not None:
            selection = self.indexer(x, q_latent, batch, state)
        else:
            assert shared_selection is not None, (
                "a shared indexer layer needs the previous selection")
            selection = shared_selection
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_dim + self.v_dim, self.kv_rank)
        w_uk, w_uv = w_kv[:, : self.qk_dim], w_kv[:, self.qk_dim:]
        q_absorbed = torch.einsum("thd,hdr->thr", q, w_uk)
        # One workspace for the split launches of every MLA layer of this forward.
        workspace = batch.cached("sparse_mla_workspace",
                                 lambda: sparse_mla_workspace(q_absorbed, selection))
        o_latent = sparse_mla(q_absorbed, latent_cache, selection, scale=self.qk_dim ** -0.5,
                              workspace=workspace)
        o = torch.einsum("thr,hvr->thv", o_latent, w_uv).reshape(num_tokens, -1)
        return self.o_proj(o), selection

    def _down_projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x's query and key-value down projections, as one product over their stacked weights
        where they stack (`stacked_linear`)."""
        pair = (self.q_a_proj, self.kv_a_proj_with_mqa)
        if not can_stack(pair):
            return self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        both = stacked_linear(pair)(x)
        return both[..., : self.q_a_proj.weight.shape[0]], both[..., self.q_a_proj.weight.shape[0]:]
