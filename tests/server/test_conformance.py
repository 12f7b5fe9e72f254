"""Details peer engines' own OpenAI-server test suites check (issue 23, item 4); the streamed
logprob details are in test_completion_logprobs.py."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def _post(live, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", timeout=60, **kwargs)


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT),
                                       ("/v1/completions", COMPLETION)], ids=["chat", "text"])
def test_stream_options_without_streaming_is_accepted(live, path, body):
    response = _post(live, path, json={**body, "stream": False,
                                       "stream_options": {"include_usage": True}})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("bias,named", [
    ({"999999": 1, "888888": 2}, ["999999", "888888"]),
    ({"x": 1, "-5": 2, "7": 1}, ["'x'", "'-5'"]),
], ids=["out-of-range", "not-ids"])
def test_logit_bias_errors_name_every_bad_key(live, bias, named):
    response = _post(live, "/v1/completions", json={**COMPLETION, "logit_bias": bias})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "logit_bias"
    assert all(key in error["message"] for key in named), error["message"]


def test_stop_token_ids_errors_name_every_bad_id(live):
    body = {**CHAT, "stop_token_ids": [3, 777777, 666666]}
    error = _post(live, "/v1/chat/completions", json=body).json()["error"]
    assert error["param"] == "stop_token_ids"
    assert "777777" in error["message"] and "666666" in error["message"]


@pytest.mark.parametrize("content_type,status", [
    ("text/plain", 415), ("application/x-www-form-urlencoded", 415),
    ("application/json; charset=utf-8", 200), ("application/vnd.api+json", 200), (None, 200)])
def test_content_type_must_be_json(live, content_type, status):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = _post(live, "/v1/completions", content=json.dumps(COMPLETION), headers=headers)
    assert response.status_code == status, response.text
    if status == 415:
        assert response.json()["error"]["code"] == "unsupported_media_type"
