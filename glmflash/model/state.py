"""Per-layer cache tensors that sequences address through slots (DESIGN.md "State per sequence").

Token slots hold one MLA latent per token per MLA layer, plus one pooled indexer key per kpool
token slots; state slots hold what is fixed-size per sequence: the KDA recurrent and conv state
and the indexer's raw tail. Who owns which slot is decided outside (the engine's cache manager).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from glmflash.config import MLA, ModelConfig
from glmflash.kernels.indexer import key_format


class ModelState:
    """The cache tensors of every layer. The fixed-size states of each kind (recurrent, conv,
    index_tail) are views into one block per kind, `[layers, state slots, ...]` (`blocks`), so
    a copy of one slot's state across every layer of a kind is one launch (the speculative
    commit, model/verify.py)."""

    STATE_KINDS = ("recurrent", "conv", "index_tail")

    def __init__(self, config: ModelConfig, *, num_token_slots: int, num_state_slots: int,
                 dtype: torch.dtype, device: torch.device | str,
                 fp8_index_keys: bool = False, fp8_index_queries: bool = False) -> None:
        """`fp8_index_keys`: pooled indexer keys as FP8 rows (kernels/indexer/key_format.py)
        instead of the model dtype; `fp8_index_queries` (FP8 keys only): the indexers score
        e4m3 query rows against them."""
        kpool = config.index_kpool
        if num_token_slots % kpool:
            raise ValueError(f"num_token_slots {num_token_slots} must be a multiple of {kpool}")
        if fp8_index_queries and not fp8_index_keys:
            raise ValueError("fp8_index_queries needs fp8_index_keys")
        self.fp8_index_queries = fp8_index_queries
        self.num_token_slots = num_token_slots
        self.num_state_slots = num_state_slots
        self.latent: dict[int, torch.Tensor] = {}
        self.pool_keys: dict[int, torch.Tensor] = {}
        for i, kind in enumerate(config.layer_types):
            if kind == MLA:
                self.latent[i] = torch.zeros(num_token_slots, config.kv_lora_rank, dtype=dtype,
                                             device=device)
                if config.indexer_types[i] == "full":
                    self.pool_keys[i] = key_format.allocate(
                        num_token_slots // kpool, config.index_head_dim, fp8_index_keys, dtype,
                        device)
        self.blocks: dict[str, StateBlock] = {
            kind: StateBlock.allocate(layers, num_state_slots, shape, dtype_, device)
            for kind, (layers, shape, dtype_) in state_rows(config, dtype).items()}
        self.recurrent = self.blocks["recurrent"].views
        self.conv = self.blocks["conv"].views
        self.index_tail = self.blocks["index_tail"].views


class StateBlock(NamedTuple):
    """One kind's fixed-size state of every layer that has it: `block` `[len(layers), rows,
    ...]` and `views[layer]` = `block[k]` for the k-th of `layers`."""

    block: torch.Tensor
    layers: list[int]
    views: dict[int, torch.Tensor]

    @staticmethod
    def allocate(layers: list[int], rows: tuple[int, ...] | int, shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device | str) -> StateBlock:
        rows = (rows,) if isinstance(rows, int) else rows
        block = torch.zeros(len(layers), *rows, *shape, dtype=dtype, device=device)
        return StateBlock(block, list(layers), {i: block[k] for k, i in enumerate(layers)})


def state_rows(config: ModelConfig, dtype: torch.dtype
               ) -> dict[str, tuple[list[int], tuple[int, ...], torch.dtype]]:
    """Per fixed-size state kind: (its layers, the shape of one slot's row, its dtype)."""
    d, heads, kpool = config.linear_head_dim, config.linear_num_heads, config.index_kpool
    kda = [i for i, kind in enumerate(config.layer_types) if kind != MLA]
    tails = [i for i, kind in enumerate(config.layer_types)
             if kind == MLA and config.indexer_types[i] == "full"]
    return {"recurrent": (kda, (heads, d, d), torch.float32),
            "conv": (kda, (3 * config.linear_dim, config.linear_conv_kernel_dim - 1), dtype),
            "index_tail": (tails, (kpool - 1, 2 * config.index_head_dim), dtype)}


def cache_bytes(config: ModelConfig, dtype: torch.dtype,
                fp8_index_keys: bool = False) -> tuple[int, int]:
    """(bytes per token slot, bytes per state slot) of a ModelState, from the config alone."""
    item = torch.empty(0, dtype=dtype).element_size()
    per_token = 0
    for i, kind in enumerate(config.layer_types):
        if kind == MLA:
            per_token += config.kv_lora_rank * item
            if config.indexer_types[i] == "full":
                # One pooled key per kpool token slots (the raw tail is per sequence).
                per_token += -(-key_format.row_bytes(config.index_head_dim, fp8_index_keys,
                                                     dtype) // config.index_kpool)
    per_slot = sum(len(layers) * math.prod(shape) * torch.empty(0, dtype=kind_dtype).element_size()
                   for layers, shape, kind_dtype in state_rows(config, dtype).values())
    return per_token, per_slot
