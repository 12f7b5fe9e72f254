"""OpenAI error objects, `{"error": {"message", "type", "param", "code"}}` (spec/chat_api.md
§4.6)."""

from __future__ import annotations

from typing import Any

OVERLOADED_RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error answered to the client in OpenAI's shape, with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def model_not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist or you do not have access to it.",
                    param="model", code="model_not_found")


def not_found(message: str) -> ApiError:
    return ApiError(404, message, code="not_found")


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(415, f"Unsupported Content-Type {content_type[:100]!r}: send the request "
                    "body as JSON with 'Content-Type: application/json'.",
                    code="unsupported_media_type")


def unauthorized() -> ApiError:
    return ApiError(401, "Incorrect or missing API key: send it as `Authorization: Bearer KEY`.",
                    code="invalid_api_key")


def overloaded() -> ApiError:
    return ApiError(503, "The engine is currently overloaded, please try again later.",
                    type="server_error", code="overloaded",
                    headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})


def unavailable(message: str, code: str) -> ApiError:
    """The server cannot serve this request now (shutting down, or its engine died)."""
    return ApiError(503, message, type="server_error", code=code)


def context_length_exceeded(max_len: int, num_prompt_tokens: int, max_tokens: int | None,
                            param: str, *, at_least: bool = False) -> ApiError:
    if max_tokens is None or at_least:
        detail = f"your prompt contains {'at least ' if at_least else ''}{num_prompt_tokens} tokens"
    else:
        detail = (f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
                  f"the prompt, {max_tokens} in the completion)")
    return bad_request(f"This model's maximum context length is {max_len} tokens. However, "
                       f"{detail}. Please reduce the length of the prompt or completion.",
                       param=param, code="context_length_exceeded")


def internal_error(message: str = "The server had an error while processing your request.",
                   ) -> ApiError:
    return ApiError(500, message, type="server_error", code="internal_error",
                    headers={"x-should-retry": "false"})
