"""The errors a caller of the engine may catch, in one place: its own, and those of the layers
below that reach the caller unchanged (a bad checkpoint, bad media), so that callers import
them from the engine and not from the model or the preprocessing packages."""

from __future__ import annotations

from glmflash.model.weights import CheckpointError
from glmflash.multimodal.media import MediaError

__all__ = ["CheckpointError", "EngineDead", "EngineOverloaded", "MediaError",
           "PromptTooLong", "STARTUP_ERRORS"]


class EngineOverloaded(RuntimeError):
    """More choices are in flight (queued or running) than max_queued_requests allows."""


class EngineDead(RuntimeError):
    """The engine thread stopped after a fatal error; no request can be served any more."""


class PromptTooLong(ValueError):
    """A prompt (with its media expanded) leaves no room for output in the context."""

    def __init__(self, num_prompt_tokens: int, max_seq_len: int) -> None:
        super().__init__(f"prompt of {num_prompt_tokens} tokens does not fit the context length "
                         f"of {max_seq_len} tokens")
        self.num_prompt_tokens, self.max_seq_len = num_prompt_tokens, max_seq_len


STARTUP_ERRORS = (ValueError, TypeError, CheckpointError, OSError)
"""What `Engine(...)` raises for a bad option, checkpoint or path (a usage error)."""
