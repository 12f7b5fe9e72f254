"""The MTP block (spec/model.md §7.3): checkpoint layer N = num_hidden_layers, which predicts the
token after next from the main model's last hidden state and the next token's embedding.

Dataflow (DeepSeek-V3 style, as the serving engines of this family use it): `h' = eh_proj([
enorm(E[next token]) | hnorm(h_main)])`, one plain pre-norm residual decoder layer (MLA + DSA
indexer, MoE; no mHC), `shared_head.norm`, then the main model's `lm_head`. `h_main` is the mean
of the main model's streams before its final norm (`GlmForCausalLM.hidden_states`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from glmflash.config import MLA, ModelConfig
from glmflash.kernels.fp8_gemm import FP8_DTYPE
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.layers import Linear, RMSNorm
from glmflash.model.mla import MultiLatentAttention
from glmflash.model.moe import MoE
from glmflash.model.state import ModelState
from glmflash.model.weights import CheckpointError, checkpoint_files, iter_state_dict_for_save


def with_mtp_layer(config: ModelConfig) -> ModelConfig:
    """`config` with the MTP block appended to the layer schedules (an MLA layer with a full
    indexer and an MoE), so that a ModelState of it has the MTP layer's caches too."""
    return dataclasses.replace(
        config, num_hidden_layers=config.num_hidden_layers + 1,
        layer_types=(*config.layer_types, MLA), indexer_types=(*config.indexer_types, "full"),
        mlp_layer_types=(*config.mlp_layer_types, "sparse"))


class MtpLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        extended = with_mtp_layer(config)
        fp8_block = config.quant.weight_block_size[0] if config.quant else None
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm, self.hnorm = RMSNorm(d, eps, dtype), RMSNorm(d, eps, dtype)
        self.eh_proj = Linear(2 * d, d, dtype)
        self.self_attn = MultiLatentAttention(extended, config.num_hidden_layers, dtype, fp8_block)
        self.mlp = MoE(extended, dtype, fp8_block)
        self.input_layernorm = RMSNorm(d, eps, dtype)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(d, eps, dtype)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
                state: ModelState) -> torch.Tensor:
        """hidden `[T, D]` (main model, position t) and the embedding of token t+1 `[T, D]` ->
        the normed state whose lm_head logits predict token t+2. `batch` lays out the MTP
        sequence (the next tokens); `state` must come from `with_mtp_layer(config)`."""
        return self.shared_head.norm(self.hidden(hidden, next_embeds, batch, state))

    def hidden(self, hidden: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch,
               state: ModelState) -> torch.Tensor:
        """`forward` before `shared_head.norm`: what a chained draft step takes as its hidden
        state (the layer's own output, not the main model's)."""
        h = self.eh_proj(torch.cat([self.enorm(next_embeds.to(hidden.dtype)),
                                    self.hnorm(hidden)], dim=-1))
        y, _ = self.self_attn(self.input_layernorm(h), batch, state, None)
        h = h + y
        return h + self.mlp(self.post_attention_layernorm(h))


class GlmMtp(nn.Module):
    """Holds the MTP layer under its checkpoint prefix `model.language_model.layers.N`."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.language_model = nn.Module()
        self.model.language_model.layers = nn.ModuleDict(
            {str(config.num_hidden_layers): MtpLayer(config, dtype)})

    @property
    def layer(self) -> MtpLayer:
        return self.model.language_model.layers[str(self.config.num_hidden_layers)]

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.layer(*args, **kwargs)

    def logits(self, model: GlmForCausalLM, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits `[N, V]` (fp32) of the layer's pre-norm output `[N, D]`:
        `shared_head.norm`, then the main model's head (its final norm and lm_head), the
        composition the layer was trained with (tools/tiny_trainer.py)."""
        return model.logits(self.layer.shared_head.norm(hidden))


def load_mtp(mtp: GlmMtp, path: str | Path) -> int:
    """Copy the checkpoint's layer-N tensors into `mtp`; every one must be present."""
    targets = dict(iter_state_dict_for_save(mtp))
    files = checkpoint_files(path)
    missing = sorted(set(targets) - set(files))
    if missing:
        raise CheckpointError(f"checkpoint {path} has no MTP layer tensors {missing[:3]} "
                              f"({len(missing)} missing)")
    handles: dict[Path, object] = {}
    with torch.no_grad():
        for name, dest in targets.items():
            shard = files[name]
            handle = handles.setdefault(shard, safe_open(str(shard), framework="pt"))
            tensor = handle.get_tensor(name)
            if tuple(tensor.shape) != tuple(dest.shape) or \
                    (dest.dtype == FP8_DTYPE) != (tensor.dtype == FP8_DTYPE):
                raise CheckpointError(f"MTP tensor {name} in {shard}: {tuple(tensor.shape)} "
                                      f"{tensor.dtype}, expected {tuple(dest.shape)} {dest.dtype}")
            dest.copy_(tensor.to(dest.dtype))
    return len(targets)
