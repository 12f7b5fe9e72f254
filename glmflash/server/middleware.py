"""ASGI middleware: the Bearer API key on /v1 routes, and counting responses by route and status.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and disconnects pass through untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from glmflash.server.errors import unauthorized
from glmflash.server.metrics import ServerMetrics
from glmflash.server.routing import error_response

_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health",
           "/metrics")
# Routes with an id in the path: one label each (the ids would make the label set unbounded).
_ID_ROUTES = (("/v1/models/", "/v1/models/{model_id}"),
              ("/v1/responses/", "/v1/responses/{response_id}"))


def route_label(path: str) -> str:
    """A bounded label for /metrics (unknown paths are `other`)."""
    for prefix, label in _ID_ROUTES:
        if path.startswith(prefix):
            return label
    return path if path in _ROUTES else "other"


class ApiMiddleware:
    def __init__(self, app: ASGIApp, *, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_label(scope["path"])

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.inc(1, route, str(message["status"]))
            await send(message)

        if self.api_key and scope["path"].startswith("/v1") and not self._is_authorized(scope):
            await error_response(unauthorized())(scope, receive, counting_send)
            return
        await self.app(scope, receive, counting_send)

    def _is_authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        value = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = value.partition(" ")
        # The header's bytes as sent (latin-1 round-trips them) against the key's UTF-8 bytes.
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1"), self.api_key.encode())
