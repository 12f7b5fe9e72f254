"""Training of the tiny model with the project's own network (glmflash.model) under autograd.

Every op runs its pure-PyTorch reference (kernels/<op>/ref.py), which is differentiable, in the
batched forms of tiny_train_ops.py. A step packs several samples into one varlen ForwardBatch
with a fresh ModelState, as a prefill of fresh sequences: the main loss is next-token
cross-entropy on the assistant tokens (the rest weighs PROMPT_WEIGHT), the MTP loss is
next-next-token cross-entropy of the MTP layer (fed the main model's detached hidden state and
the next token's embedding), and each indexer learns where its layer's dense attention would go
(tiny_indexer_loss.py). Expert load is balanced without an auxiliary loss: after each step every
router's `e_score_correction_bias` moves towards the under-used experts (the release's
bias-update rule).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.model.forward_batch import ForwardBatch, build_forward_batch, contiguous_page_table
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.moe import MoE
from glmflash.model.mtp import GlmMtp, with_mtp_layer
from glmflash.model.state import ModelState
from glmflash.tiny.checkpoint import random_like
from glmflash.utils.device import upload
from tools.tiny_batches import HostBatch
from tools.tiny_indexer_loss import MlaInputs, indexer_loss

PAGE_SIZE = 16
MTP_LOSS_WEIGHT = 0.3
INDEXER_LOSS_WEIGHT = 1.0
BIAS_UPDATE_RATE = 1e-3


def build_models(config: ModelConfig, seed: int) -> tuple[GlmForCausalLM, GlmMtp]:
    """fp32, unquantised, trainable copies of the network and its MTP layer, seeded (made on
    the CPU: the same weights whatever the training device)."""
    plain = dataclasses.replace(config, quant=None)
    model, mtp = GlmForCausalLM(plain, torch.float32), GlmMtp(plain, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    for module in (model, mtp):
        for name, param in module.named_parameters():
            param.data.copy_(random_like(name, param.data, generator))
            param.requires_grad_(_is_trained(name))
    for moe in moe_layers(model, mtp):
        moe.gate.e_score_correction_bias.data.zero_()
    return model, mtp


def _is_trained(name: str) -> bool:
    # The router bias is set by the balancing rule. (The indexer learns from its own loss only:
    # no gradient reaches it through the top-k choice.)
    return not name.endswith("e_score_correction_bias")


def moe_layers(*modules: nn.Module) -> list[MoE]:
    return [m for module in modules for m in module.modules() if isinstance(m, MoE)]


def packed_batch(lens: list[int], ids: np.ndarray, device: torch.device | str) -> ForwardBatch:
    """A ForwardBatch of fresh sequences of `lens` tokens (`ids` back to back), each in its own
    row of a contiguous page table."""
    pages = -(-max(lens) // PAGE_SIZE)
    table = contiguous_page_table(len(lens), max(lens), PAGE_SIZE, device)
    cu = np.cumsum([0, *lens])
    seq = np.repeat(np.arange(len(lens)), lens)
    slots = seq * pages * PAGE_SIZE + np.arange(cu[-1]) - cu[:-1][seq]
    return build_forward_batch(ids, slots, cu.tolist(), [0] * len(lens),
                               list(range(len(lens))), table, PAGE_SIZE)


@dataclasses.dataclass
class LossRows:
    """Which rows each loss reads (host arrays, from the sequence offsets alone)."""

    rows: np.ndarray
    """Rows t with a next token in their sequence (row t predicts t + 1; MTP row j, of the
    sequence of tokens 1.., stands for main row rows[j] and predicts rows[j] + 2)."""
    mtp_valid: np.ndarray
    """The MTP rows whose token t + 2 exists."""

    @classmethod
    def of(cls, cu_seqlens: list[int]) -> LossRows:
        cu = np.asarray(cu_seqlens)
        lens = np.diff(cu) - 1
        seq = np.repeat(np.arange(len(lens)), lens)
        rows = np.arange(lens.sum()) + seq  # sequence b skips the b last rows before it
        return cls(rows, rows + 2 < cu[1:][seq])


def forward_losses(model: GlmForCausalLM, mtp: GlmMtp, host: HostBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(main loss, MTP loss, indexer loss, assistant tokens) of one packed batch, on the
    models' device."""
    device = model.lm_head.weight.device
    lens = np.diff(host.cu_seqlens).tolist()
    state = ModelState(with_mtp_layer(model.config),
                       num_token_slots=len(lens) * -(-max(lens) // PAGE_SIZE) * PAGE_SIZE,
                       num_state_slots=len(lens), dtype=torch.float32, device=device)
    plan = LossRows.of(host.cu_seqlens)
    mtp_target = plan.rows[plan.mtp_valid] + 2
    parts = upload(np.concatenate([plan.rows, plan.rows + 1, np.flatnonzero(plan.mtp_valid),
                                   mtp_target]), device).split(
        [plan.rows.size, plan.rows.size, mtp_target.size, mtp_target.size])
    rows, next_rows, mtp_rows, mtp_target_rows = parts
    weight = upload(host.weights, device, torch.float32)
    inputs = MlaInputs(model, mtp)
    try:
        batch = packed_batch(lens, host.ids, device)
        batch.input_embeds = _embeds(model, batch.input_ids, host)
        hidden = model.hidden_states(batch, state)
        ids = batch.input_ids
        loss = _weighted_ce(model.logits(hidden[rows]), ids[next_rows], weight[next_rows])
        mtp_ids = host.ids[np.setdiff1d(np.arange(len(host.ids)), host.cu_seqlens[:-1])]
        mtp_batch = packed_batch([n - 1 for n in lens], mtp_ids, device)
        embeds = model.text.embed_tokens(mtp_batch.input_ids)
        mtp_hidden = mtp(hidden.detach()[rows], embeds, mtp_batch, state)
        mtp_loss = _weighted_ce(model.logits(mtp_hidden[mtp_rows]), ids[mtp_target_rows],
                                weight[mtp_target_rows])
        index_loss = indexer_loss(inputs.records)
    finally:
        inputs.remove()
    return loss, mtp_loss, index_loss, int(host.is_trained[plan.rows + 1].sum())


def _embeds(model: GlmForCausalLM, ids: torch.Tensor, host: HostBatch) -> torch.Tensor:
    """Token embeddings `[T, D]`, the vision tower's features on the pictures' tokens."""
    embeds = model.text.embed_tokens(ids)
    if host.pixel_values is None:
        return embeds
    device = embeds.device
    features = model.visual.features(upload(host.pixel_values, device, torch.float32),
                                     torch.from_numpy(host.grid_thw))
    rows = upload(np.flatnonzero(host.ids == model.config.image_token_id), device)
    return embeds.index_put((rows,), features.to(embeds.dtype))


def _weighted_ce(logits: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor
                 ) -> torch.Tensor:
    ce = nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    return (ce * weight).sum() / weight.sum()


def balance_routers(moes: list[MoE], counts: list[torch.Tensor]) -> None:
    """Move each router's bias towards its under-used experts, then reset the counts."""
    for moe, count in zip(moes, counts, strict=True):
        moe.gate.e_score_correction_bias.data += BIAS_UPDATE_RATE * torch.sign(
            count.float().mean() - count.float())
        count.zero_()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
