"""A test-only logits processor that makes the model emit a scripted token sequence."""

from __future__ import annotations

import torch


class ScriptedOutput:
    """Forces token `script[i]` at output step i (then eos, if given)."""

    def __init__(self, script: list[int], eos_token_id: int | None = None) -> None:
        self.script = list(script) + ([eos_token_id] if eos_token_id is not None else [])

    def __call__(self, output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        step = len(output_ids)
        if step >= len(self.script):
            return logits
        forced = torch.full_like(logits, float("-inf"))
        forced[self.script[step]] = 0.0
        return forced
