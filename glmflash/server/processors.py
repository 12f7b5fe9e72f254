"""Logits processors the server adds to a request: logit_bias and tool_choice enforcement.

Each is stateless (it reads only the output ids so far), so one instance serves all `n` choices.
The special-token scans are list.index calls (C loops), cheap at any output length. They run
on the logits' device with no host sync: index tensors are copied to a device once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

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

    It follows the output parsers' state, read from the special tokens at their places, not
    from any occurrence: the reasoning ends at the first `</think>` or `<tool_call>`; content
    starts after it; the first call opens at the first `<tool_call>` of the content and closes at
    the first `</tool_call>` after that. So a tag the model writes inside its reasoning (a
    `</tool_call>` there once switched enforcement off) changes nothing.

    * reasoning: free, but end-of-sequence and stop tokens are banned;
    * content, no call yet: the next token is `<tool_call>`;
    * inside the first call: the name is one of `names` (token by token), then `<arg_key>` or
      `</tool_call>`; the arguments are free but may not end the generation, open another call
      or close a think block (the parser would not read the call);
    * after the first call: nothing is forced.
    """

    def __init__(self, ids: ToolTokenIds, banned_ids: list[int], names: list[list[int]],
                 *, starts_in_reasoning: bool) -> None:
        self.ids = ids
        self.banned_ids = DeviceCopies(torch.tensor(sorted(set(banned_ids)), dtype=torch.long))
        self.banned_in_call = DeviceCopies(torch.tensor(
            sorted({*banned_ids, ids.call_start, ids.think_end}), dtype=torch.long))
        self.names = NameTrie(names)
        self.starts_in_reasoning = starts_in_reasoning

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        content_start = self._content_start(output_ids)
        if content_start is None:
            return _ban(logits, self.banned_ids)
        call_start = _find(output_ids, self.ids.call_start, content_start)
        if call_start is None:
            return _only(logits, [self.ids.call_start])
        if _find(output_ids, self.ids.call_end, call_start + 1) is not None:
            return logits
        allowed = self.names.next_ids(output_ids[call_start + 1:])
        if allowed is None:
            return _ban(logits, self.banned_in_call)
        ends = [self.ids.arg_key, self.ids.call_end] if allowed.is_complete else []
        return _only(logits, [*allowed.ids, *ends])

    def _content_start(self, output_ids: list[int]) -> int | None:
        """Where the content begins (None: still reasoning), as the reasoning parser splits."""
        if not self.starts_in_reasoning:
            return 0
        think_end = _find(output_ids, self.ids.think_end, 0)
        call_start = _find(output_ids, self.ids.call_start, 0)
        if call_start is not None and (think_end is None or call_start < think_end):
            return call_start
        return None if think_end is None else think_end + 1


class NameChoice(NamedTuple):
    ids: list[int]
    """Token ids that continue some allowed name."""
    is_complete: bool
    """The tokens so far spell a whole allowed name."""


class NameTrie:
    """The allowed function names as token sequences, walked one token at a time."""

    def __init__(self, names: list[list[int]]) -> None:
        self.root: dict = {}
        for name in names:
            node = self.root
            for token_id in name:
                node = node.setdefault(token_id, {})
            node[_END] = {}

    def next_ids(self, prefix: list[int]) -> NameChoice | None:
        """What may follow `prefix`; None once `prefix` has left the name (the arguments)."""
        node = self.root
        for token_id in prefix:
            if token_id not in node:
                return None
            node = node[token_id]
        return NameChoice([t for t in node if t is not _END], _END in node)


# Marks the end of a name in NameTrie (never a token id).
_END = object()


def _find(ids: list[int], token_id: int, start: int) -> int | None:
    try:
        return ids.index(token_id, start)
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
