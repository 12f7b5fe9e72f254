"""Request size limits, checked before the expensive work: the body's bytes (413, without reading
a body whose Content-Length is already too large), the JSON values in it (JSON parsing holds the
GIL, so a body of millions of numbers would stall the event loop), and a lower bound on the prompt
tokens that needs no tokenizer (a 400 context_length_exceeded before template rendering)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmflash.server.errors import ApiError
from glmflash.utils.memory import trim

# Commas and colons a body may hold (each JSON value but the first of a container follows one):
# 2**20 parse in about 0.1 s; a prompt that fits the context never needs more than 4 per token.
MIN_MAX_JSON_SEPARATORS = 1 << 20
SEPARATORS_PER_TOKEN = 4
# After a body this large the allocator's free pages go back to the OS, at most once a second.
TRIM_AFTER_BYTES = 1 << 20
TRIM_INTERVAL_S = 1.0


def too_large(num_bytes: int | None, limit: int) -> ApiError:
    size = "" if num_bytes is None else f" of {num_bytes} bytes"
    return ApiError(413, f"The request body{size} is larger than this server's limit of {limit} "
                    "bytes (--max-request-bytes).", code="request_too_large",
                    headers={"Connection": "close"})


def max_json_separators(max_seq_len: int) -> int:
    return max(MIN_MAX_JSON_SEPARATORS, SEPARATORS_PER_TOKEN * max_seq_len)


def check_json_size(body: bytes, max_separators: int) -> None:
    """413 for a body with more JSON values than any request that fits the context needs."""
    count = body.count(b",") + body.count(b":")
    if count > max_separators:
        raise ApiError(413, f"The request body holds about {count} JSON values, more than any "
                       f"request that fits this server's context ({max_separators}).",
                       code="request_too_large")


class BodyLimitMiddleware:
    """413 for a body past `max_bytes`: at once from Content-Length, or as the body streams in."""

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._last_trim = 0.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            error = too_large(declared, self.max_bytes)
            response = JSONResponse(error.body(), status_code=error.status, headers=error.headers)
            await response(scope, receive, send)
            return
        num_received = 0

        async def counting_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self.max_bytes:
                    raise too_large(None, self.max_bytes)
            return message

        try:
            await self.app(scope, counting_receive, send)
        finally:
            if max(num_received, declared or 0) >= TRIM_AFTER_BYTES:
                self._trim_soon()

    def _trim_soon(self) -> None:
        now = time.monotonic()
        if now - self._last_trim >= TRIM_INTERVAL_S:
            self._last_trim = now
            asyncio.get_running_loop().run_in_executor(None, trim)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def min_num_tokens(texts: Iterable[str], max_token_bytes: int) -> int:
    """Fewest tokens `texts` (disjoint parts of one prompt) can encode to: no token stands for
    more than `max_token_bytes` bytes, and a character is at least one byte."""
    return sum(len(text) for text in texts) // max_token_bytes


def chat_texts(messages: list[dict[str, Any]]) -> Iterable[str]:
    """The message texts the chat template writes out verbatim (a lower bound of the prompt)."""
    for message in messages:
        # NOTE: assistant content is stripped by the template; stripping each part removes at
        # least as much as stripping their concatenation, so the bound holds.
        strip = str.strip if message.get("role") == "assistant" else str
        content = message.get("content")
        if isinstance(content, str):
            yield strip(content)
        elif isinstance(content, list):
            yield from (strip(part["text"]) for part in content
                        if isinstance(part, dict) and isinstance(part.get("text"), str))
