"""Training of the tiny model with the project's own network (glmflash.model) under autograd.

On the CPU every op runs its pure-PyTorch reference (kernels/<op>/ref.py), which is
differentiable. A step packs several samples into one varlen ForwardBatch with a fresh
ModelState, as a prefill of fresh sequences: the main loss is next-token cross-entropy on the
assistant tokens (the rest weighs PROMPT_WEIGHT), the MTP loss is next-next-token cross-entropy
of the MTP layer (fed the main model's detached hidden state and the next token's embedding),
and each indexer learns where its layer's dense attention would go (tiny_indexer_loss.py).
Expert load is balanced without an auxiliary loss: after each step every router's
`e_score_correction_bias` moves towards the under-used experts (the release's bias-update rule).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.model.forward_batch import build_forward_batch, contiguous_page_table, token_slots_of
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import Router
from glmflash.model.mtp import GlmMtp, with_mtp_layer
from glmflash.model.state import ModelState
from glmflash.tiny.checkpoint import random_like
from tools.tiny_data import Sample
from tools.tiny_indexer_loss import MlaInputs, indexer_loss

PAGE_SIZE = 16
MTP_LOSS_WEIGHT = 0.3
INDEXER_LOSS_WEIGHT = 1.0
# Loss weight of the tokens outside the assistant turns (prompts, tool schemas, tool results).
PROMPT_WEIGHT = 0.25
BIAS_UPDATE_RATE = 1e-3


def build_models(config: ModelConfig, seed: int) -> tuple[GlmForCausalLM, GlmMtp]:
    """fp32, unquantised, trainable copies of the network and its MTP layer, seeded."""
    plain = dataclasses.replace(config, quant=None)
    model, mtp = GlmForCausalLM(plain, torch.float32), GlmMtp(plain, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for module in (model, mtp):
        for name, param in module.named_parameters():
            param.data.copy_(random_like(name, param.data, generator))
            param.requires_grad_(_is_trained(name))
    for router in routers(model, mtp):
        router.e_score_correction_bias.data.zero_()
    return model, mtp


def _is_trained(name: str) -> bool:
    # The router bias is set by the balancing rule. (The indexer learns from its own loss only:
    # no gradient reaches it through the top-k choice.)
    return not name.endswith("e_score_correction_bias")


def routers(*modules: nn.Module) -> list[Router]:
    return [m for module in modules for m in module.modules() if isinstance(m, Router)]


def _batch(seqs: list[list[int]], device: str = "cpu"):
    lens = [len(s) for s in seqs]
    table = contiguous_page_table(len(seqs), max(lens), PAGE_SIZE, device)
    slots = [token_slots_of(table[b].tolist(), 0, n, PAGE_SIZE) for b, n in enumerate(lens)]
    return build_forward_batch(np.concatenate(seqs), np.concatenate(slots),
                               np.cumsum([0, *lens]).tolist(), [0] * len(seqs),
                               list(range(len(seqs))), table, PAGE_SIZE)


def forward_losses(model: GlmForCausalLM, mtp: GlmMtp, samples: list[Sample]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(main loss, MTP loss, indexer loss, assistant tokens) of one packed batch."""
    config = with_mtp_layer(model.config)
    max_len = max(len(s.ids) for s in samples)
    pages = -(-max_len // PAGE_SIZE)
    state = ModelState(config, num_token_slots=len(samples) * pages * PAGE_SIZE,
                       num_state_slots=len(samples), dtype=torch.float32, device="cpu")
    inputs = MlaInputs(model, mtp)
    try:
        batch = _batch([s.ids for s in samples])
        ids = torch.tensor(np.concatenate([s.ids for s in samples]))
        batch.input_embeds = _embeds(model, ids, samples)
        hidden = model.hidden_states(batch, state)
        mask = torch.tensor(np.concatenate([s.mask for s in samples]), dtype=torch.bool)
        weight = torch.where(mask, 1.0, PROMPT_WEIGHT)
        ends = torch.tensor(batch.cu_seqlens[1:])
        # Row t predicts token t+1 of the same sequence; the MTP row t predicts token t+2.
        rows = torch.cat([torch.arange(a, b - 1) for a, b in
                          zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)])
        loss = _weighted_ce(model.logits(hidden[rows]), ids[rows + 1], weight[rows + 1])
        # The MTP sequence of sample b is its tokens 1..n-1: MTP row j is main row rows[j].
        mtp_batch = _batch([s.ids[1:] for s in samples])
        embeds = model.text.embed_tokens(mtp_batch.input_ids)
        mtp_hidden = mtp(hidden.detach()[rows], embeds, mtp_batch, state)
        seq_of_row = torch.searchsorted(ends, rows, right=True)
        valid = rows + 2 < ends[seq_of_row]
        target = (rows + 2)[valid]
        mtp_loss = _weighted_ce(model.logits(mtp_hidden[valid]), ids[target], weight[target])
        index_loss = indexer_loss(inputs.records)
    finally:
        inputs.remove()
    return loss, mtp_loss, index_loss, int(mask[rows + 1].sum())


def _embeds(model: GlmForCausalLM, ids: torch.Tensor, samples: list[Sample]) -> torch.Tensor:
    """Token embeddings `[T, D]`, the vision tower's features on the pictures' tokens."""
    embeds = model.text.embed_tokens(ids)
    images = [s.image_inputs for s in samples if s.image_inputs is not None]
    if not images:
        return embeds
    features = model.visual.features(torch.cat([i.pixel_values for i in images]),
                                     torch.cat([i.grid_thw for i in images]))
    rows = torch.nonzero(ids == model.config.image_token_id).squeeze(1)
    return embeds.index_put((rows,), features.to(embeds.dtype))


def _weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
                 ) -> torch.Tensor:
    ce = nn.functional.cross_entropy(logits, targets, reduction="none")
    return (ce * weight).sum() / weight.sum()


def balance_routers(model: nn.Module, mtp: nn.Module, counts: list[torch.Tensor]) -> None:
    """Move each router's bias towards its under-used experts, then reset the counts."""
    for router, count in zip(routers(model, mtp), counts, strict=True):
        router.e_score_correction_bias.data += BIAS_UPDATE_RATE * torch.sign(
            count.float().mean() - count.float())
        count.zero_()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pack(samples: list[Sample], max_tokens: int) -> list[list[Sample]]:
    """Consecutive samples grouped into batches of at most `max_tokens` tokens."""
    batches, current, size = [], [], 0
    for sample in samples:
        if current and size + len(sample.ids) > max_tokens:
            batches.append(current)
            current, size = [], 0
        current.append(sample)
        size += len(sample.ids)
    if current:
        batches.append(current)
    return batches
