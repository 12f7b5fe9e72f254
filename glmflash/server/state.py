"""What every route shares (plain context): the engine bridge, served names, parser switches,
sampling defaults, the stored responses. Turning a request into engine inputs is
engine_input.py's job."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from glmflash.server.args import DEFAULT_GRACEFUL_TIMEOUT_S, DEFAULT_MAX_REQUEST_BYTES
from glmflash.server.async_engine import AsyncEngine
from glmflash.server.engine_input import PreparedRequest, RequestHook
from glmflash.server.errors import model_not_found, unavailable
from glmflash.server.lifecycle import Lifecycle
from glmflash.server.limits import max_json_separators
from glmflash.server.logprobs import TokenText
from glmflash.server.responses_store import DEFAULT_MAX_STORED_RESPONSES, ResponseStore

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine

logger = logging.getLogger(__name__)
__all__ = ["PreparedRequest", "RequestHook", "ServerConfig", "ServerState"]

# generation_config.json keys a request that omits them inherits (as vLLM does).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    """The first name is the primary one (reported when a request omits `model`)."""
    api_key: str | None = None
    tool_call_parser: str = "glm47"
    """glm47, or none (tool-call markup stays in `content`)."""
    reasoning_parser: str = "glm45"
    """glm45, or none (reasoning stays in `content`)."""
    graceful_shutdown_timeout_s: float = DEFAULT_GRACEFUL_TIMEOUT_S
    """After SIGINT/SIGTERM, how long running requests may go on before they are ended."""
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """Larger request bodies are answered 413 without being read."""
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES
    """/v1/responses kept for previous_response_id (least recently used dropped first)."""


class ServerState:
    def __init__(self, engine: Engine, config: ServerConfig,
                 request_hook: RequestHook | None = None) -> None:
        self.engine = engine
        self.bridge = AsyncEngine(engine)
        self.lifecycle = Lifecycle(self.bridge, config.graceful_shutdown_timeout_s)
        self.config = config
        self.request_hook = request_hook
        self.created = int(time.time())
        self.token_text = TokenText(engine.tokenizer)
        self.responses = ResponseStore(config.max_stored_responses)
        self.sampling_defaults = read_generation_defaults(engine.model_path)
        self.max_json_separators = max_json_separators(engine.max_seq_len)
        logger.debug("prompt bound: at most %d bytes per token", engine.tokenizer.max_token_bytes)

    def check_admitting(self) -> None:
        """503 once the server drains for shutdown or its engine has died."""
        if self.lifecycle.is_draining or self.bridge.is_closed:
            raise unavailable("The server is shutting down.", "shutting_down")

    def resolve_model(self, name: str | None) -> str:
        if name is None:
            return self.config.served_model_names[0]
        if name not in self.config.served_model_names:
            raise model_not_found(name)
        return name


def read_generation_defaults(model_path: Path) -> dict[str, Any]:
    path = Path(model_path) / "generation_config.json"
    if not path.is_file():
        return {}
    config = json.loads(path.read_text(encoding="utf-8"))
    defaults = {k: config[k] for k in _GENERATION_DEFAULTS if config.get(k) is not None}
    if defaults:
        logger.info("sampling defaults from generation_config.json: %s", defaults)
    return defaults
