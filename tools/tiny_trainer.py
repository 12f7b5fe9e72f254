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
from tools.tiny_train_ops import count_only

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


@dataclasses.dataclass
class StepTensors:
    """The device side of one training batch: the main and MTP forwards' batches (their input
    ids inside), the loss weights, the rows each loss reads, and the pictures."""

    batch: ForwardBatch
    mtp_batch: ForwardBatch
    weight: torch.Tensor
    rows: torch.Tensor
    next_rows: torch.Tensor
    mtp_rows: torch.Tensor
    mtp_target_rows: torch.Tensor
    pixel_values: torch.Tensor | None
    grid_thw: torch.Tensor | None
    picture_rows: torch.Tensor | None
    """The row of each picture feature: its `<|image|>` token, or one past the last row (blank
    pictures)."""
    counted: torch.Tensor
    """`[T]` 1 on the samples' tokens, 0 on padding (whose expert choices are not counted)."""
    mtp_counted: torch.Tensor
    num_token_slots: int
    num_trained: int
    """Assistant tokens that are targets of the main loss (host count)."""


def step_tensors(host: HostBatch, device: torch.device | str, config: ModelConfig
                 ) -> StepTensors:
    lens = np.diff(host.cu_seqlens).tolist()
    plan = LossRows.of(host.cu_seqlens)
    mtp_target = plan.rows[plan.mtp_valid] + 2
    parts = upload(np.concatenate([plan.rows, plan.rows + 1, np.flatnonzero(plan.mtp_valid),
                                   mtp_target]), device).split(
        [plan.rows.size, plan.rows.size, mtp_target.size, mtp_target.size])
    pictures = (None, None, None)
    if host.pixel_values is not None:
        merge = config.vision.spatial_merge_size
        rows = np.flatnonzero(host.ids == config.image_token_id)
        num_features = int(np.prod(host.grid_thw, axis=1).sum()) // merge ** 2
        rows = np.concatenate([rows, np.full(num_features - rows.size, len(host.ids))])
        pictures = (upload(host.pixel_values, device, torch.float32),
                    torch.from_numpy(host.grid_thw), upload(rows, device))
    counted = np.ones(len(host.ids), np.float32) if host.is_padding is None else \
        (~host.is_padding).astype(np.float32)
    # The MTP forward's rows: each sequence without its first token.
    mtp_index = np.setdiff1d(np.arange(len(host.ids)), host.cu_seqlens[:-1])
    return StepTensors(
        packed_batch(lens, host.ids, device), packed_batch([n - 1 for n in lens],
                                                           host.ids[mtp_index], device),
        upload(host.weights, device, torch.float32), *parts, *pictures,
        upload(counted, device, torch.float32), upload(counted[mtp_index], device,
                                                       torch.float32),
        num_token_slots=len(lens) * -(-max(lens) // PAGE_SIZE) * PAGE_SIZE,
        num_trained=int(host.is_trained[plan.rows + 1].sum()))


def forward_losses(model: GlmForCausalLM, mtp: GlmMtp, host: HostBatch
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(main loss, MTP loss, indexer loss, assistant tokens) of one packed batch, on the
    models' device."""
    tensors = step_tensors(host, model.lm_head.weight.device, model.config)
    return (*step_losses(model, mtp, tensors), tensors.num_trained)


def step_losses(model: GlmForCausalLM, mtp: GlmMtp, tensors: StepTensors
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(main loss, MTP loss, indexer loss) of a batch already on the models' device."""
    device = model.lm_head.weight.device
    batch, ids, weight = tensors.batch, tensors.batch.input_ids, tensors.weight
    state = ModelState(with_mtp_layer(model.config), num_token_slots=tensors.num_token_slots,
                       num_state_slots=len(batch.cu_seqlens) - 1, dtype=torch.float32,
                       device=device)
    count_only(model, tensors.counted)
    count_only(mtp, tensors.mtp_counted)
    inputs = MlaInputs(model, mtp)
    try:
        batch.input_embeds = _embeds(model, ids, tensors)
        hidden = model.hidden_states(batch, state)
        hidden_rows = hidden.index_select(0, tensors.rows)
        loss = _weighted_ce(model.logits(hidden_rows), ids[tensors.next_rows],
                            weight[tensors.next_rows])
        embeds = model.text.embed_tokens(tensors.mtp_batch.input_ids)
        mtp_hidden = mtp(hidden_rows.detach(), embeds, tensors.mtp_batch, state)
        target_rows = tensors.mtp_target_rows
        mtp_loss = _weighted_ce(model.logits(mtp_hidden.index_select(0, tensors.mtp_rows)),
                                ids[target_rows],
                                weight[target_rows])
        index_loss = indexer_loss(inputs.records, {id(batch): tensors.counted,
                                                   id(tensors.mtp_batch): tensors.mtp_counted})
    finally:
        inputs.remove()
    return loss, mtp_loss, index_loss


def _embeds(model: GlmForCausalLM, ids: torch.Tensor, tensors: StepTensors) -> torch.Tensor:
    """Token embeddings `[T, D]`, the vision tower's features on the pictures' tokens."""
    embeds = model.text.embed_tokens(ids)
    if tensors.pixel_values is None:
        return embeds
    features = model.visual.features(tensors.pixel_values, tensors.grid_thw)
    # One spare row takes the blank pictures' features.
    spare = torch.cat([embeds, embeds.new_zeros(1, embeds.shape[1])])
    return spare.index_put((tensors.picture_rows,), features.to(embeds.dtype))[:-1]


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
