"""The response shapes chat and completions share: the header every response and chunk carries,
a streamed chunk, the usage object and the stream's last (usage) chunk."""

from __future__ import annotations

import time
import uuid
from typing import Any


def response_header(id_prefix: str, kind: str, model: str) -> dict[str, Any]:
    """`id`, `object`, `created`, `model`, `system_fingerprint` (the same for every chunk)."""
    return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": model, "system_fingerprint": None}


def stream_chunk(header: dict[str, Any], choice: dict[str, Any],
                 include_usage: bool) -> dict[str, Any]:
    """One chunk of one choice; with stream_options.include_usage every chunk has `usage: null`."""
    out = {**header, "choices": [choice]}
    if include_usage:
        out["usage"] = None
    return out


def usage(num_prompt_tokens: int, num_output_tokens: int, num_cached_tokens: int,
          num_reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object: prompt tokens taken from the prefix cache in
    `prompt_tokens_details`; chat adds the reasoning tokens' count."""
    out: dict[str, Any] = {"prompt_tokens": num_prompt_tokens,
                           "completion_tokens": num_output_tokens,
                           "total_tokens": num_prompt_tokens + num_output_tokens,
                           "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}
    if num_reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
    return out


def usage_chunk(header: dict[str, Any], totals: dict[str, Any]) -> dict[str, Any]:
    """A stream's last chunk: no choices, the request's usage."""
    return {**header, "choices": [], "usage": totals}
