"""Training of the tiny model with the project's own network (glmflash.model) under autograd.

On the CPU every op runs its pure-PyTorch reference (kernels/<op>/ref.py), which is
differentiable. A step packs several samples into one varlen ForwardBatch with a fresh
ModelState, as a prefill of fresh sequences: the main loss is next-token cross-entropy on the
masked positions, the MTP loss is next-next-token cross-entropy of the MTP layer (fed the main
model's detached hidden state and the next token's embedding). Expert load is balanced without an
auxiliary loss: after each step every router's `e_score_correction_bias` moves towards the
under-used experts (the release's bias-update rule).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

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

PAGE_SIZE = 16
MTP_LOSS_WEIGHT = 0.3
BIAS_UPDATE_RATE = 1e-3


@dataclass
class StepLosses:
    loss: float
    mtp_loss: float
    num_tokens: int


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
    # The indexer chooses slots by top-k: no gradient reaches it through the LM loss. The
    # router bias is set by the balancing rule.
    return ".indexer." not in name and not name.endswith("e_score_correction_bias")


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
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(main loss, MTP loss, trained tokens) of one packed batch, with gradients."""
    config = with_mtp_layer(model.config)
    max_len = max(len(s.ids) for s in samples)
    pages = -(-max_len // PAGE_SIZE)
    state = ModelState(config, num_token_slots=len(samples) * pages * PAGE_SIZE,
                       num_state_slots=len(samples), dtype=torch.float32, device="cpu")
    batch = _batch([s.ids for s in samples])
    hidden = model.hidden_states(batch, state)
    ids = torch.tensor(np.concatenate([s.ids for s in samples]))
    mask = torch.tensor(np.concatenate([s.mask for s in samples]), dtype=torch.bool)
    starts = batch.cu_seqlens[:-1]
    ends = batch.cu_seqlens[1:]
    # Row t predicts token t+1 of the same sequence; the MTP row t predicts token t+2.
    rows = torch.cat([torch.arange(a, b - 1) for a, b in zip(starts, ends, strict=True)])
    keep = mask[rows + 1]
    loss = nn.functional.cross_entropy(model.logits(hidden[rows[keep]]), ids[rows[keep] + 1])
    mtp_batch = _batch([s.ids[1:] for s in samples])
    mtp_rows = rows  # the MTP sequence of sample b is its tokens 1..n-1: row t sits at t - b
    offsets = torch.repeat_interleave(torch.arange(len(samples)),
                                      torch.tensor([b - a - 1 for a, b in zip(starts, ends,
                                                                              strict=True)]))
    embeds = model.text.embed_tokens(mtp_batch.input_ids)
    mtp_hidden = mtp(hidden.detach()[mtp_rows], embeds, mtp_batch, state)
    mtp_keep = torch.zeros_like(keep)
    has_next_next = (mtp_rows + 2) < torch.tensor(ends)[offsets]
    mtp_keep[has_next_next] = mask[(mtp_rows + 2)[has_next_next]]
    target_rows = mtp_rows[mtp_keep] + 2
    mtp_loss = nn.functional.cross_entropy(model.logits(mtp_hidden[mtp_keep]), ids[target_rows])
    return loss, mtp_loss, int(keep.sum())


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
