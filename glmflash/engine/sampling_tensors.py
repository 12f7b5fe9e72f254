"""One step's per-row sampling options as device tensors: one host-to-device copy per dtype."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmflash.engine.rng import to_int64
from glmflash.engine.sequence import Sequence
from glmflash.sampling_params import SamplingParams
from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.engine.penalties import PenaltyState


@dataclass(slots=True)
class PenaltyTensors:
    """The rows that use repetition, presence or frequency penalties."""

    rows: torch.Tensor
    """`[P]` int64 batch rows."""
    slots: torch.Tensor
    """`[P]` int64 rows of the PenaltyState counts."""
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor
    """`[P]` fp32 each."""
    seq_ids: list[int]


@dataclass(slots=True)
class SamplingTensors:
    """What the sampler needs of a batch's SamplingParams; S rows draw, R rows want logprobs."""

    sample_rows: torch.Tensor | None
    """`[S]` int64 batch rows with temperature > 0; None when every row is greedy."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    """`[S]` int64; the vocabulary size where there is no cut."""
    top_p: torch.Tensor
    """`[S]` fp32; inf where there is no cut (1.0 would cut the tail that rounding puts past 1)."""
    min_p: torch.Tensor
    keys: torch.Tensor
    """`[S]` int64 random keys: the request's seed, or this step's key plus the row."""
    positions: torch.Tensor
    """`[S]` int64 output position of the token being drawn."""
    use_top_k_or_p: bool
    use_min_p: bool
    logprob_rows: torch.Tensor | None
    """`[R]` int64 rows whose sequences asked for logprobs; None when none did."""
    num_logprobs: list[int]
    """`[R]` how many top logprobs each of those rows wants (host)."""
    processor_rows: list[int]
    penalties: PenaltyTensors | None

    @property
    def is_plain_greedy(self) -> bool:
        """One argmax of the raw logits gives every id."""
        return self.sample_rows is None and self.logprob_rows is None \
            and self.penalties is None and not self.processor_rows

    @classmethod
    def build(cls, seqs: list[Sequence], vocab_size: int, device: torch.device, step_key: int,
              penalty_state: PenaltyState,
              output_offsets: list[int] | None = None) -> SamplingTensors:
        params = [seq.params for seq in seqs]
        offsets = output_offsets or [0] * len(seqs)
        sample_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        drawn = [params[i] for i in sample_rows]
        logprob_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        penalty_rows = [i for i, p in enumerate(params) if uses_penalties(p)]
        slots = penalty_state.prepare([seqs[i] for i in penalty_rows], vocab_size, device)
        keys = [to_int64(p.seed if p.seed is not None else step_key + i)
                for i, p in zip(sample_rows, drawn, strict=True)]
        temperature, top_p, min_p, repetition, presence, frequency = to_device([
            [p.temperature for p in drawn], [p.top_p if p.top_p < 1 else math.inf for p in drawn],
            [p.min_p for p in drawn], *_penalty_columns([params[i] for i in penalty_rows]),
        ], torch.float32, device)
        rows, top_k, keys, positions, logprob_ids, penalty_ids, slot_ids = to_device([
            sample_rows, [p.top_k or vocab_size for p in drawn], keys,
            [seqs[i].num_output_tokens + offsets[i] for i in sample_rows], logprob_rows,
            penalty_rows, slots,
        ], torch.int64, device)
        penalties = PenaltyTensors(penalty_ids, slot_ids, repetition, presence, frequency,
                                   [seqs[i].seq_id for i in penalty_rows]) if penalty_rows else None
        return cls(rows if sample_rows else None, temperature, top_k, top_p, min_p, keys,
                   positions, any(p.top_k or p.top_p < 1 for p in drawn),
                   any(p.min_p > 0 for p in drawn), logprob_ids if logprob_rows else None,
                   [params[i].logprobs for i in logprob_rows],
                   [i for i, p in enumerate(params) if p.logits_processors], penalties)


def uses_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty) \
        or bool(params.frequency_penalty)


def _penalty_columns(params: list[SamplingParams]) -> list[list[float]]:
    return [[p.repetition_penalty for p in params], [p.presence_penalty for p in params],
            [p.frequency_penalty for p in params]]


def to_device(columns: list[list], dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Host lists as device tensors through one non-blocking copy (pinned when the device is CUDA).

    NOTE: a blocking host-to-device copy would synchronise the stream in the middle of a step.
    """
    flat = [x for column in columns for x in column]
    sizes = [len(column) for column in columns]
    if not flat:
        return [torch.empty(0, dtype=dtype, device=device) for _ in columns]
    return list(upload(flat, device, dtype).split(sizes))
