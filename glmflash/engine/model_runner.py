"""Owns the model, its cache tensors and the device inputs: sequences in, last-token logits out."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.engine.sequence import Sequence
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.state import ModelState
from glmflash.model.weights import load_checkpoint

logger = logging.getLogger(__name__)


def load_model(path: Path, config: ModelConfig, device: torch.device,
               dtype: torch.dtype) -> GlmForCausalLM:
    with torch.device(device):
        model = GlmForCausalLM(config, dtype)
    load_checkpoint(model, path, num_layers=config.num_hidden_layers)
    return model.eval()


class ModelRunner:
    """Each sequence owns one state slot and a contiguous range of `max_seq_len` token slots."""

    def __init__(self, model: GlmForCausalLM, *, max_num_seqs: int, max_seq_len: int) -> None:
        config = model.config
        self.model = model
        self.device = next(model.parameters()).device
        kpool = config.index_kpool
        self.max_seq_len = -(-max_seq_len // kpool) * kpool
        self.state = ModelState(config, num_token_slots=max_num_seqs * self.max_seq_len,
                                num_state_slots=max_num_seqs, dtype=model.dtype,
                                device=self.device)
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        logger.info("cache: %d sequences x %d tokens", max_num_seqs, self.max_seq_len)

    def can_allocate(self) -> bool:
        return bool(self.free_slots)

    def allocate(self, seq: Sequence) -> None:
        seq.state_slot = self.free_slots.pop()

    def free(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = None

    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Forward every uncomputed token of `seqs` in one packed batch; `[B, V]` logits."""
        batch = self.prepare(seqs)
        logits = self.model(batch, self.state)
        for seq in seqs:
            seq.num_computed_tokens = seq.num_tokens
        return logits

    def prepare(self, seqs: list[Sequence]) -> ForwardBatch:
        ids, token_slots, context_slots = [], [], []
        cu_seqlens, cu_context, prefix_lens = [0], [0], []
        for seq in seqs:
            base = seq.state_slot * self.max_seq_len
            start, end = seq.num_computed_tokens, seq.num_tokens
            ids += seq.token_ids[start:end]
            token_slots += range(base + start, base + end)
            context_slots += range(base, base + end)
            cu_seqlens.append(len(ids))
            cu_context.append(len(context_slots))
            prefix_lens.append(start)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        return ForwardBatch(input_ids=as_tensor(ids), cu_seqlens=cu_seqlens,
                            prefix_lens=prefix_lens, state_slots=[s.state_slot for s in seqs],
                            token_slots=as_tensor(token_slots),
                            context_slots=as_tensor(context_slots), cu_context=cu_context)
