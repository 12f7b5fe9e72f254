"""What one forward needs to know about its batch.

That is the packed varlen layout of the new tokens and where each sequence's cache lives: its
state slot, which is also its row of the page table. Nothing here grows with the context: a
sequence's earlier tokens are reached through its page-table row on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from glmflash.utils.device import upload

if TYPE_CHECKING:
    from glmflash.model.verify import VerifyInputs


@dataclass
class DecodeRows:
    """The geometry of B decodes (one new token per sequence, which has earlier tokens) held in
    device tensors, so that one recorded forward serves every batch of B decodes: a CUDA graph
    replays it after new values are copied into the same tensors. No host value in it depends on
    the sequences except `max_pools`, a bound."""

    positions: torch.Tensor
    """`[B]` int64 position of each new token (the tokens its sequence has cached)."""
    state_slots: torch.Tensor
    """`[B]` int64 state slot (and page-table row) of each sequence."""
    kda_meta: torch.Tensor
    """`[B, 3]` int32 rows (token row, state slot, fresh) of the KDA decode kernel."""
    conv_meta: torch.Tensor
    """`[B, 5]` int32 rows (first token, start, end, state slot, fresh) of the conv kernel."""
    max_pools: int
    """Pools the indexer scores per row: at least every row's number of complete pools."""


@dataclass
class ForwardBatch:
    """B sequences, each contributing `cu_seqlens[b+1] - cu_seqlens[b]` new tokens.

    Host lists (O(B)) size the launches; tensors are on the model's device.
    """

    input_ids: torch.Tensor
    """`[T]` token ids of the new tokens, sequences back to back."""
    cu_seqlens: list[int] | None
    """B+1 offsets of each sequence's new tokens in `input_ids` (None in a decode batch)."""
    prefix_lens: list[int] | None
    """Tokens each sequence already has in the cache before this forward (None in a decode
    batch)."""
    state_slots: list[int] | None
    """Fixed-size state slot per sequence (KDA recurrent + conv state, indexer tail); also the
    sequence's row of `page_table` (None in a decode batch)."""
    token_slots: torch.Tensor
    """`[T]` cache slot that each new token's MLA latent is written to."""
    page_table: torch.Tensor
    """`[R, P]` int32 page ids per state slot: token position p of the sequence in slot r lives
    in cache slot `page_table[r, p // page_size] * page_size + p % page_size`."""
    page_size: int
    logits_index: torch.Tensor
    """`[N]` rows of `input_ids` whose logits the forward returns (without `all_logits`): the
    last new token of each sampled sequence, then any extra rows (prompt log-probabilities)."""
    input_embeds: torch.Tensor | None = None
    """`[T, D]` embeddings overriding the lookup (multimodal rows already merged)."""
    decode: DecodeRows | None = None
    """Set for a batch of decodes: their geometry on the device, in place of the host lists."""
    verify: VerifyInputs | None = None
    """Set for a verify forward (speculative decoding): every sequence is a decode plus its
    drafts, whose fixed-size state advances position by position (model/verify.py)."""
    memo: dict[str, Any] = field(default_factory=dict)
    """Per-forward results that every layer shares (e.g. the indexer's write plan)."""

    @property
    def is_fresh(self) -> list[bool]:
        """Sequences whose first token is in this forward (their fixed state starts at zero)."""
        return [p == 0 for p in self.prefix_lens]

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """`build()` once per forward; later layers get the same value."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]


def token_slots_of(page_ids: list[int], start: int, num_tokens: int,
                   page_size: int) -> np.ndarray:
    """Cache slots of positions start..start+num_tokens-1 of a sequence owning `page_ids`."""
    pos = np.arange(start, start + num_tokens, dtype=np.int64)
    # Only the pages these positions touch are converted: O(new tokens), not O(context).
    first = start // page_size
    touched = np.asarray(page_ids[first: (start + num_tokens - 1) // page_size + 1],
                         dtype=np.int64)
    return touched[pos // page_size - first] * page_size + pos % page_size


def build_forward_batch(input_ids: np.ndarray | list[int], token_slots: np.ndarray | list[int],
                        cu_seqlens: list[int], prefix_lens: list[int], state_slots: list[int],
                        page_table: torch.Tensor, page_size: int, *,
                        logit_seqs: list[int] | None = None,
                        extra_logit_rows: list[int] | None = None,
                        input_embeds: torch.Tensor | None = None) -> ForwardBatch:
    """A ForwardBatch whose integer inputs reach the device in one asynchronous copy.

    `logit_seqs`: the sequences whose last new token's logits are wanted (default: all);
    `extra_logit_rows`: more rows whose logits are wanted, after those.
    """
    num_tokens = cu_seqlens[-1]
    if logit_seqs is None:
        logit_seqs = list(range(len(prefix_lens)))
    last_rows = [cu_seqlens[b + 1] - 1 for b in logit_seqs]
    if extra_logit_rows:
        last_rows += extra_logit_rows
    packed = np.concatenate([np.asarray(input_ids, dtype=np.int64).reshape(-1),
                             np.asarray(token_slots, dtype=np.int64).reshape(-1),
                             np.asarray(last_rows, dtype=np.int64)])
    device_ints = upload(packed, page_table.device)
    return ForwardBatch(input_ids=device_ints[:num_tokens],
                        cu_seqlens=list(cu_seqlens), prefix_lens=list(prefix_lens),
                        state_slots=list(state_slots),
                        token_slots=device_ints[num_tokens: 2 * num_tokens],
                        page_table=page_table, page_size=page_size,
                        logits_index=device_ints[2 * num_tokens:], input_embeds=input_embeds)


def contiguous_page_table(num_slots: int, max_tokens: int, page_size: int,
                          device: torch.device | str) -> torch.Tensor:
    """A page table giving slot r the pages r*P .. r*P+P-1 (P = pages per `max_tokens`): the
    layout of tests and one-off forwards that own a whole cache."""
    pages = -(-max_tokens // page_size)
    return torch.arange(num_slots * pages, dtype=torch.int32, device=device).view(num_slots, pages)


DECODE_INT64_FIELDS = 5  # input id, token slot, position, state slot, logits row
DECODE_INT32_FIELDS = 8  # KDA meta (3), conv meta (5)
DECODE_WIDTH = DECODE_INT64_FIELDS + DECODE_INT32_FIELDS // 2
"""int64 words per decode row in the packed upload."""


def pack_decode(input_ids: list[int], token_slots: list[int], positions: list[int],
                state_slots: list[int], fresh: list[int] | None = None) -> np.ndarray:
    """The host side of a decode batch: one int64 array of `DECODE_WIDTH * B` words, laid out
    as `decode_batch` reads it. `fresh` marks rows whose state starts at zero (padding rows)."""
    num = len(input_ids)
    fresh = fresh if fresh is not None else [0] * num
    rows = np.arange(num, dtype=np.int32)
    slots32 = np.asarray(state_slots, dtype=np.int32)
    fresh32 = np.asarray(fresh, dtype=np.int32)
    kda_meta = np.stack([rows, slots32, fresh32], axis=1)
    conv_meta = np.stack([rows, rows, rows + 1, slots32, fresh32], axis=1)
    int32_part = np.concatenate([kda_meta.reshape(-1), conv_meta.reshape(-1)])
    int64_part = np.asarray([input_ids, token_slots, positions, state_slots, np.arange(num)],
                            dtype=np.int64).reshape(-1)
    return np.concatenate([int64_part, int32_part.view(np.int64)])


def decode_batch(packed: torch.Tensor, page_table: torch.Tensor, page_size: int,
                 max_pools: int) -> ForwardBatch:
    """The ForwardBatch of B decodes whose inputs are views of `packed` (device, from
    `pack_decode`): writing new values into `packed` changes the batch in place."""
    num = packed.numel() // DECODE_WIDTH
    ints = packed[: DECODE_INT64_FIELDS * num].view(DECODE_INT64_FIELDS, num)
    metas = packed[DECODE_INT64_FIELDS * num:].view(torch.int32)
    rows = DecodeRows(positions=ints[2], state_slots=ints[3],
                      kda_meta=metas[: 3 * num].view(num, 3),
                      conv_meta=metas[3 * num:].view(num, 5), max_pools=max_pools)
    return ForwardBatch(input_ids=ints[0], cu_seqlens=None, prefix_lens=None, state_slots=None,
                        token_slots=ints[1], page_table=page_table, page_size=page_size,
                        logits_index=ints[4], decode=rows)
