"""GLM-5.3-Flash network (spec §10).

embed -> N x (mHC[mixer], mHC[ffn]) -> stream mean -> norm -> lm_head.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from glmflash.config import KDA, ModelConfig
from glmflash.kernels.hyper import hyper_post, hyper_pre
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.kda import KimiDeltaAttention
from glmflash.model.layers import MLP, Linear, RMSNorm
from glmflash.model.media import MediaTokenIds, embed_multimodal
from glmflash.model.mla import MultiLatentAttention
from glmflash.model.moe import MoE
from glmflash.model.state import ModelState
from glmflash.model.vision import VisionTower

if TYPE_CHECKING:
    from glmflash.multimodal.image import ImageInputs
    from glmflash.multimodal.video import VideoInputs


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype,
                 fp8_block: int | None) -> None:
        super().__init__()
        self.is_kda = config.layer_types[layer_idx] == KDA
        self.self_attn = KimiDeltaAttention(config, layer_idx, dtype) if self.is_kda \
            else MultiLatentAttention(config, layer_idx, dtype, fp8_block)
        if config.mlp_layer_types[layer_idx] == "sparse":
            self.mlp = MoE(config, dtype, fp8_block)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit,
                           dtype, fp8_block)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        s, width = config.hc_mult, config.hc_mult * config.hidden_size
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", _param((2 + s) * s, width, dtype=dtype))
            self.register_parameter(f"hc_{part}_base", _param((2 + s) * s, dtype=torch.float32))
            self.register_parameter(f"hc_{part}_scale", _param(3, dtype=torch.float32))
        self.hc_kwargs = dict(norm_eps=config.rms_norm_eps, hc_eps=config.hc_eps,
                              sinkhorn_iters=config.hc_sinkhorn_iters)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch, state: ModelState,
                selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """streams `[T, S, D]` -> new streams, and the MLA selection for a shared next layer."""
        post, comb, x = hyper_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale,
                                  norm=self.input_layernorm.as_pair(), **self.hc_kwargs)
        if self.is_kda:
            y, selection = self.self_attn(x, batch, state), None
        else:
            y, selection = self.self_attn(x, batch, state, selection)
        streams = hyper_post(y, streams, post, comb)
        post, comb, x = hyper_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale,
                                  norm=self.post_attention_layernorm.as_pair(), **self.hc_kwargs)
        if isinstance(self.mlp, MoE) and self.mlp.sum_in_consumer:
            routed, shared = self.mlp.parts(x, unsummed=True)
            return hyper_post(routed, streams, post, comb, extra=shared), selection
        return hyper_post(self.mlp(x), streams, post, comb), selection


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        fp8_block = config.quant.weight_block_size[0] if config.quant else None
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, fp8_block)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.hc_mult = config.hc_mult


class GlmForCausalLM(nn.Module):
    """The text path of Glm5NextForConditionalGeneration; parameter names match the checkpoint."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = nn.Module()
        self.model.language_model = TextModel(config, dtype)
        if config.vision is not None:
            self.model.visual = VisionTower(config.vision, config.hidden_size, dtype)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, dtype)

    @property
    def text(self) -> TextModel:
        return self.model.language_model

    @property
    def visual(self) -> VisionTower | None:
        return getattr(self.model, "visual", None)

    def embed_multimodal(self, token_ids: list[int], image_inputs: ImageInputs | None,
                         video_inputs: VideoInputs | None) -> torch.Tensor:
        """Prompt embeddings `[T, D]` with the vision tower's features on its media tokens."""
        return embed_multimodal(self.text.embed_tokens, self.visual, token_ids, image_inputs,
                                video_inputs, media=MediaTokenIds.from_config(self.config))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, state: ModelState, *,
                all_logits: bool = False, layer_outputs: list | None = None) -> torch.Tensor:
        """Logits of the rows in `batch.logits_index` `[N, V]` (or of every token `[T, V]`)."""
        h = self.hidden_states(batch, state, layer_outputs=layer_outputs)
        if not all_logits:
            h = h[batch.logits_index]
        return self.logits(h)

    def hidden_states(self, batch: ForwardBatch, state: ModelState, *,
                      layer_outputs: list | None = None) -> torch.Tensor:
        """The streams' mean after the last layer `[T, D]`, before the final norm (outside
        inference mode, so that training can take gradients through it)."""
        x = batch.input_embeds if batch.input_embeds is not None \
            else self.text.embed_tokens(batch.input_ids)
        streams = x.to(self.dtype).unsqueeze(1).expand(-1, self.text.hc_mult, -1).contiguous()
        selection = None
        for layer in self.text.layers:
            streams, selection = layer(streams, batch, state, selection)
            if layer_outputs is not None:
                layer_outputs.append(streams)
        return streams.mean(dim=1)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[N, V]` of hidden states `[N, D]` (final norm, then lm_head)."""
        return self.lm_head(self.text.norm(hidden)).float()


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
