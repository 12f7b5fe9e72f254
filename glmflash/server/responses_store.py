"""Stored responses for `previous_response_id` and `GET /v1/responses/{id}`, bounded in memory.

Each entry keeps the response object and the conversation it ends (every earlier input and
output item, then its own), so a follow-up request renders the whole exchange. The least
recently used entries go first once either bound (a count, and the entries' JSON size) is passed.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_BYTES = 256 << 20


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    """Input and output items of every turn up to and including this response."""
    num_bytes: int


class ResponseStore:
    def __init__(self, max_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                 max_bytes: int = DEFAULT_MAX_STORED_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        num_bytes = len(json.dumps(response)) + len(json.dumps(conversation))
        with self._lock:
            self._drop(response["id"])
            self._entries[response["id"]] = StoredResponse(response, conversation, num_bytes)
            self.num_bytes += num_bytes
            while len(self._entries) > self.max_responses or \
                    self.num_bytes > self.max_bytes and len(self._entries) > 1:
                oldest = next(iter(self._entries))
                logger.debug("response store full: dropping %s", oldest)
                self._drop(oldest)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True
