"""The OpenAI-compatible HTTP surface: Starlette routes only (the work lives in chat.py,
chat_stream.py, completions.py, responses*.py; plumbing in routing.py, streaming.py,
middleware.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from glmflash.server import responses
from glmflash.server.chat import chat_completion
from glmflash.server.chat_stream import chat_completion_stream
from glmflash.server.completions import completion, completion_stream
from glmflash.server.errors import model_not_found, not_found
from glmflash.server.limits import BodyLimitMiddleware
from glmflash.server.metrics import CONTENT_TYPE
from glmflash.server.middleware import ApiMiddleware
from glmflash.server.protocol import parse_chat_request, parse_completion_request
from glmflash.server.responses_request import parse_responses_request
from glmflash.server.responses_stream import create_response_stream
from glmflash.server.routing import api_route, http_exception, read_json
from glmflash.server.state import RequestHook, ServerConfig, ServerState
from glmflash.server.streaming import sse_response, until_disconnected

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "glmflash",
            "root": str(state.engine.model_path), "max_model_len": state.engine.max_seq_len}


@api_route
async def list_models(request: Request) -> Response:
    state = _state(request)
    cards = [_model_card(state, name) for name in state.config.served_model_names]
    return JSONResponse({"object": "list", "data": cards})


@api_route
async def retrieve_model(request: Request) -> Response:
    state, name = _state(request), request.path_params["model_id"]
    if name not in state.config.served_model_names:
        raise model_not_found(name)
    return JSONResponse(_model_card(state, name))


@api_route
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    return await _generate(request, lambda raw: parse_chat_request(
        raw, supports_media=state.bridge.supports_media), chat_completion_stream, chat_completion)


@api_route
async def completions(request: Request) -> Response:
    return await _generate(request, parse_completion_request, completion_stream, completion)


@api_route
async def create_response(request: Request) -> Response:
    return await _generate(request, parse_responses_request, create_response_stream,
                           responses.create_response, named_events=True)


async def _generate(request: Request, parse, stream, once, *,
                    named_events: bool = False) -> Response:
    """The shape every generation route shares: admit, parse the body, resolve the model, then
    a server-sent event stream or one JSON response (abandoned if the client goes away)."""
    state = _state(request)
    state.check_admitting()
    body = parse(await read_json(request, state.max_json_separators))
    model = state.resolve_model(body.model)
    if body.stream:
        events, group = await stream(state, body, model)
        return sse_response(events, group.close, is_named=named_events)
    return JSONResponse(await until_disconnected(request, once(state, body, model)))


@api_route
async def retrieve_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = _state(request).responses.get(response_id)
    if stored is None:
        raise not_found(f"Response with id '{response_id}' not found.")
    return JSONResponse(stored.response)


@api_route
async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not _state(request).responses.delete(response_id):
        raise not_found(f"Response with id '{response_id}' not found.")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


@api_route
async def health(request: Request) -> Response:
    state = _state(request)
    failure = state.engine.failure
    if failure is not None:
        return JSONResponse({"status": "engine stopped", "error": failure}, status_code=503)
    if state.lifecycle.is_draining or state.bridge.is_closed:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    return JSONResponse({"status": "ok"})


@api_route
async def metrics(request: Request) -> Response:
    return Response(_state(request).bridge.metrics.render(), media_type=CONTENT_TYPE)


@contextlib.asynccontextmanager
async def _lifespan(app: Starlette) -> AsyncIterator[None]:
    """While the server runs, a task watches the engine thread (see Lifecycle.watch_engine)."""
    lifecycle = app.state.server.lifecycle
    watcher = asyncio.create_task(lifecycle.watch_engine())
    try:
        yield
    finally:
        watcher.cancel()
        lifecycle.close()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


def create_app(engine: Engine, config: ServerConfig, *,
               request_hook: RequestHook | None = None) -> Starlette:
    """The server app for `engine`. `request_hook` is for tests only (it is never reachable from
    HTTP): it sees each validated request and its PreparedRequest before submission."""
    state = ServerState(engine, config, request_hook)
    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", retrieve_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", retrieve_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    middleware = [Middleware(ApiMiddleware, api_key=config.api_key,
                             metrics=state.bridge.metrics),
                  Middleware(BodyLimitMiddleware, max_bytes=config.max_request_bytes)]
    app = Starlette(routes=routes, middleware=middleware, lifespan=_lifespan,
                    exception_handlers={HTTPException: http_exception})
    app.state.server = state
    return app
