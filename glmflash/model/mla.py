"""MLA (NoPE) attention over the DSA indexer's selection, in absorbed-latent form (spec §4)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.rms_norm import rms_norm_pair
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
        latent_cache = state.latent[self.layer_idx]
        q_latent = self._latents(x, latent_cache, batch.token_slots)
        q = self.q_b_proj(q_latent).view(num_tokens, self.num_heads, self.qk_dim)
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

    def _latents(self, x: torch.Tensor, latent_cache: torch.Tensor,
                 token_slots: torch.Tensor) -> torch.Tensor:
        """The query latent (normed), with the key-value latent (normed) written into the cache
        at the tokens' slots. Where the two down projections stack (`stacked_linear`), one
        product and one launch for both norms and the cache write (`rms_norm_pair`)."""
        down = self.stack_weights()
        if down is None:
            latent_cache[token_slots] = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)).to(
                latent_cache.dtype)
            return self.q_a_layernorm(self.q_a_proj(x))
        return rms_norm_pair(down(x), *self.q_a_layernorm.as_pair(),
                             *self.kv_a_layernorm.as_pair(), latent_cache, token_slots)

    def stack_weights(self) -> Linear | None:
        """The two down projections' stacked Linear (built once; None where they do not
        stack)."""
        pair = (self.q_a_proj, self.kv_a_proj_with_mqa)
        return stacked_linear(pair) if can_stack(pair) else None
