"""Per-layer cache tensors that sequences address through slots (DESIGN.md "State per sequence").

Token slots hold one MLA latent per token per MLA layer, plus one pooled indexer key per kpool
token slots; state slots hold what is fixed-size per sequence: the KDA recurrent and conv state
and the indexer's raw tail. Who owns which slot is decided outside (the engine's cache manager).
"""

from __future__ import annotations

import torch

from glmflash.config import MLA, ModelConfig


class ModelState:
    def __init__(self, config: ModelConfig, *, num_token_slots: int, num_state_slots: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        kpool = config.index_kpool
        if num_token_slots % kpool:
            raise ValueError(f"num_token_slots {num_token_slots} must be a multiple of {kpool}")
        self.num_token_slots = num_token_slots
        self.num_state_slots = num_state_slots
        conv_channels = 3 * config.linear_dim
        self.latent: dict[int, torch.Tensor] = {}
        self.pool_keys: dict[int, torch.Tensor] = {}
        self.index_tail: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}
        self.conv: dict[int, torch.Tensor] = {}
        for i, kind in enumerate(config.layer_types):
            if kind == MLA:
                self.latent[i] = torch.zeros(num_token_slots, config.kv_lora_rank, dtype=dtype,
                                             device=device)
                if config.indexer_types[i] == "full":
                    self.pool_keys[i] = torch.zeros(num_token_slots // kpool, config.index_head_dim,
                                                    dtype=dtype, device=device)
                    self.index_tail[i] = torch.zeros(num_state_slots, kpool - 1,
                                                      2 * config.index_head_dim, dtype=dtype,
                                                      device=device)
            else:
                d = config.linear_head_dim
                self.recurrent[i] = torch.zeros(num_state_slots, config.linear_num_heads, d, d,
                                                dtype=torch.float32, device=device)
                self.conv[i] = torch.zeros(num_state_slots, conv_channels,
                                           config.linear_conv_kernel_dim - 1, dtype=dtype,
                                           device=device)


def cache_bytes(config: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes per token slot, bytes per state slot) of a ModelState, from the config alone."""
    item = torch.empty(0, dtype=dtype).element_size()
    per_token = per_slot = 0
    for i, kind in enumerate(config.layer_types):
        if kind == MLA:
            per_token += config.kv_lora_rank * item
            if config.indexer_types[i] == "full":
                # One pooled key per kpool token slots, plus the raw tail per sequence.
                per_token += -(-config.index_head_dim * item // config.index_kpool)
                per_slot += (config.index_kpool - 1) * 2 * config.index_head_dim * item
        else:
            d = config.linear_head_dim
            per_slot += config.linear_num_heads * d * d * 4
            per_slot += 3 * config.linear_dim * (config.linear_conv_kernel_dim - 1) * item
    return per_token, per_slot
