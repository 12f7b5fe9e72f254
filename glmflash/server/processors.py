"""Logits processors the server adds to a request: logit_bias and tool_choice enforcement.

Each is stateless (it reads only the output ids so far), so one instance serves all `n` choices.
They run on the logits' device with no host sync: index tensors are copied to a device once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmflash.parsers.tags import ARG_KEY_START, THINK_END, TOOL_CALL_END, TOOL_CALL_START
from glmflash.tokenizer import Tokenizer


class DeviceCopies:
    """A host tensor and its copy on each device it was asked for, made once, non-blocking.

    NOTE: indexing a device tensor with a host tensor or list copies it with a host sync.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.copies = {tensor.device: tensor}

    def on(self, device: torch.device) -> torch.Tensor:
        if device not in self.copies:
            self.copies[device] = self.copies[torch.device("cpu")].to(device, non_blocking=True)
        return self.copies[device]


class LogitBias:
    """OpenAI `logit_bias`: add a value in [-100, 100] to the logits of chosen token ids."""

    def __init__(self, bias: dict[int, float]) -> None:
        self.token_ids = DeviceCopies(torch.tensor(list(bias), dtype=torch.long))
        self.values = DeviceCopies(torch.tensor(list(bias.values()), dtype=torch.float32))

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        token_ids = self.token_ids.on(logits.device)
        values = self.values.on(logits.device).to(logits.dtype)
        return logits.index_add(0, token_ids, values)


@dataclass(frozen=True)
class ToolTokenIds:
    think_end: int
    call_start: int
    call_end: int
    arg_key: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ToolTokenIds | None:
        """None when the tokenizer lacks one of the single-token GLM tags."""
        ids = [tokenizer.token_to_id(t) for t in (THINK_END, TOOL_CALL_START, TOOL_CALL_END,
                                                  ARG_KEY_START)]
        return None if None in ids else cls(*ids)


class ForcedToolCall:
    """tool_choice `required` or a named function: after the reasoning, the answer is a call.

    Reasoning runs freely (but may not end the generation); once `</think>` is out, the next token
    is `<tool_call>`; for a named function its name follows, then `<arg_key>` or `</tool_call>`.
    End-of-sequence tokens stay banned until the first call is closed; after it, nothing is forced.
    """

    def __init__(self, ids: ToolTokenIds, banned_ids: list[int], name_ids: list[int] | None,
                 *, starts_in_reasoning: bool) -> None:
        self.ids = ids
        self.banned_ids = DeviceCopies(torch.tensor(sorted(banned_ids), dtype=torch.long))
        self.name_ids = name_ids
        self.starts_in_reasoning = starts_in_reasoning

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if self.ids.call_end in output_ids:
            return logits
        start = _index(output_ids, self.ids.call_start)
        if start is None:
            if not self.starts_in_reasoning or self.ids.think_end in output_ids:
                return _only(logits, [self.ids.call_start])
            return _ban(logits, self.banned_ids)
        if self.name_ids is not None:
            num_after = len(output_ids) - start - 1
            if num_after < len(self.name_ids):
                return _only(logits, [self.name_ids[num_after]])
            if num_after == len(self.name_ids):
                return _only(logits, [self.ids.arg_key, self.ids.call_end])
        return _ban(logits, self.banned_ids)


def _index(ids: list[int], token_id: int) -> int | None:
    try:
        return ids.index(token_id)
    except ValueError:
        return None


def _only(logits: torch.Tensor, allowed: list[int]) -> torch.Tensor:
    out = torch.full_like(logits, float("-inf"))
    for token_id in allowed:
        # An int index is a view: no index tensor to copy to the device.
        out[token_id] = logits[token_id]
    return out


def _ban(logits: torch.Tensor, banned: DeviceCopies) -> torch.Tensor:
    return logits.index_fill(0, banned.on(logits.device), float("-inf"))
