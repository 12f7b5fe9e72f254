"""Helpers every route uses: the JSON body, OpenAI-shaped error responses, and one decorator
that turns any failure into one (bad input never takes the server down)."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from glmflash.server.async_engine import EngineFailure, failure_error
from glmflash.server.errors import (
    ApiError,
    bad_request,
    internal_error,
    not_found,
    unsupported_media_type,
)
from glmflash.server.limits import check_json_size
from glmflash.server.streaming import ClientDisconnected

logger = logging.getLogger(__name__)
# nginx's "client closed request"; only /metrics ever sees it.
CLIENT_CLOSED_STATUS = 499
Handler = Callable[[Request], Awaitable[Response]]


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def read_json(request: Request, max_separators: int | None = None) -> Any:
    """The JSON body. A Content-Type other than JSON is a 415 (as peers answer); none at all is
    taken as JSON."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not is_json_media_type(content_type):
        raise unsupported_media_type(content_type)
    body = await request.body()
    if max_separators is not None:
        check_json_size(body, max_separators)
    try:
        value = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise bad_request(f"We could not parse the JSON body of your request: {exc}") from exc
    if b"\\u" in body:  # only an escape can write a lone surrogate into JSON text
        try:
            _refuse_lone_surrogates(value, "")
        except RecursionError as exc:
            raise bad_request("The JSON body of your request is nested too deeply") from exc
    return value


def _refuse_lone_surrogates(value: Any, path: str) -> None:
    """A 400 naming the first string holding half a UTF-16 surrogate pair (JSON escapes allow
    it; no tokenizer takes it)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"'{path or 'body'}' holds an unpaired UTF-16 surrogate escape",
                              param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, f"{path}[{i}]")


def is_json_media_type(content_type: str) -> bool:
    media_type = content_type.split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/")
                                                 and media_type.endswith("+json"))


def api_route(handler: Handler) -> Handler:
    @functools.wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except ClientDisconnected:
            logger.debug("client disconnected from %s; request aborted", request.url.path)
            return Response(status_code=CLIENT_CLOSED_STATUS)
        except EngineFailure as exc:
            return error_response(failure_error(exc))
        except Exception:
            logger.exception("request to %s failed", request.url.path)
            return error_response(internal_error())
    return wrapped


async def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own 404 / 405 in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(not_found(f"Unknown route {request.method} {request.url.path}"))
    error = ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}",
                     headers=dict(exc.headers or {}))
    return error_response(error)
