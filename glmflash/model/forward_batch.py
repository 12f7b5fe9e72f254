"""What one forward needs to know about its batch.

That is the packed varlen layout of the new tokens and where each sequence's state is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """B sequences, each contributing `cu_seqlens[b+1] - cu_seqlens[b]` new tokens.

    Host lists are the schedule; tensors are on the model's device.
    """

    input_ids: torch.Tensor
    """`[T]` token ids of the new tokens, sequences back to back."""
    cu_seqlens: list[int]
    """B+1 offsets of each sequence's new tokens in `input_ids`."""
    prefix_lens: list[int]
    """Tokens each sequence already has in the cache before this forward."""
    state_slots: list[int]
    """Fixed-size state slot per sequence (KDA recurrent + conv state, indexer tail)."""
    token_slots: torch.Tensor
    """`[T]` cache slot that each new token's MLA latent is written to."""
    context_slots: torch.Tensor
    """Cache slots of every sequence's whole context (prefix + new), back to back."""
    cu_context: list[int]
    """B+1 offsets into `context_slots`."""
    input_embeds: torch.Tensor | None = None
    """`[T, D]` embeddings overriding the lookup (multimodal rows already merged)."""

    @property
    def is_fresh(self) -> list[bool]:
        """Sequences whose first token is in this forward (their fixed state starts at zero)."""
        return [p == 0 for p in self.prefix_lens]

    @property
    def last_token_index(self) -> torch.Tensor:
        """`[B]` row of each sequence's last new token."""
        return torch.tensor(self.cu_seqlens[1:], device=self.input_ids.device) - 1
