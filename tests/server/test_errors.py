"""Every error case answers OpenAI's error object with the right status, and none of them takes
the server down."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest

from glmflash.server.chat import _check_json
from glmflash.server.errors import ApiError
from glmflash.server.fields import Fields
from glmflash.server.messages import route_media_part
from glmflash.server.middleware import ApiMiddleware, route_label
from glmflash.server.protocol import _template_kwargs
from tests.server.conftest import API_KEY, MODEL

HI = [{"role": "user", "content": "hi"}]


def _post(live, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", timeout=30, **kwargs)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": HI, "max_tokens": 2, **fields}


@pytest.mark.parametrize("body,param", [
    (_chat(temperature="hot"), "temperature"),
    (_chat(temperature=2.5), "temperature"),
    (_chat(max_tokens=0), "max_tokens"),
    (_chat(max_completion_tokens=True), "max_completion_tokens"),
    (_chat(n=0), "n"),
    (_chat(top_p=0), "top_p"),
    (_chat(top_logprobs=3), "top_logprobs"),
    (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_chat(stop_token_ids=[99999]), "stop_token_ids"),
    (_chat(logit_bias={"x": 1}), "logit_bias"),
    (_chat(seed="7"), "seed"),
    (_chat(stream="yes"), "stream"),
    (_chat(messages=[]), "messages"),
    ({"model": MODEL}, "messages"),
    (_chat(messages="hi"), "messages"),
    (_chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
    (_chat(messages=[{"content": "hi"}]), "messages[0].role"),
    (_chat(messages=[{"role": "user"}]), "messages[0].content"),
    (_chat(messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    (_chat(messages=[*HI, {"role": "tool", "content": "sunny"}]), "messages[1].tool_call_id"),
    (_chat(messages=[*HI, {"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{}"}}]}]), "messages[1].tool_calls[0].id"),
    (_chat(messages=[*HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "{oops"}}]}]), "messages[1].tool_calls[0].function.arguments"),
    # Nesting past the JSON parser's stack (RecursionError, not a JSONDecodeError).
    (_chat(messages=[*HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": {
        "name": "f", "arguments": "[" * 5000}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (_chat(messages=[{"role": "user", "content": [{"type": "input_audio"}]}]),
     "messages[0].content[0].type"),
    (_chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages[0].content[0].text"),
    (_chat(tools=[{"type": "function"}]), "tools[0].function"),
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="sometimes"),
     "tool_choice"),
    (_chat(tool_choice="required"), "tool_choice"),
    (_chat(tools=[{"type": "function", "function": {"name": "f"}}],
           tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
    (_chat(response_format={"type": "xml"}), "response_format.type"),
    (_chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
    (_chat(reasoning_effort="extreme"), "reasoning_effort"),
    (_chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
])
def test_invalid_chat_fields(live, body, param):
    error = _error(_post(live, "/v1/chat/completions", json=body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_media_gate_without_engine_support():
    part = Fields({"type": "image_url", "image_url": {"url": "data:,"}}, "messages[0].content[1].")
    with pytest.raises(ApiError) as info:
        route_media_part(part, "image_url", supports_media=False)
    assert info.value.status == 400
    assert info.value.message == "image input is not supported by this server build"


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize("parts,message", [
    ([_image_part("data:image/png;base64,AAAA")], "image"),
    ([_image_part("/etc/passwd")], "local media paths are disabled"),
    ([_image_part("data:image/png;base64,AAAA")] * 9, "at most 8 images"),
    ([{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}], "video"),
])
def test_bad_media_is_a_400(live, parts, message):
    content = [{"type": "text", "text": "what is this?"}, *parts]
    error = _error(_post(live, "/v1/chat/completions",
                         json=_chat(messages=[{"role": "user", "content": content}])), 400)
    assert error["code"] == "invalid_media" and message in error["message"]


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "prompt": "hi", "suffix": "x"}, "suffix"),
    ({"model": MODEL, "prompt": [5, 99999]}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [[]]}, "prompt"),
    ({"model": MODEL, "prompt": [1, "a"]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 6}, "logprobs"),
    # 33 prompts of 128 choices: more than a request may queue (a fan-out froze the loop).
    ({"model": MODEL, "prompt": ["hi"] * 33, "n": 128}, "prompt"),
])
def test_invalid_completion_fields(live, body, param):
    assert _error(_post(live, "/v1/completions", json=body), 400)["param"] == param


def test_malformed_json_and_bodies(live):
    error = _error(_post(live, "/v1/chat/completions", content=b"{not json"), 400)
    assert "JSON" in error["message"]
    _error(_post(live, "/v1/chat/completions", json=[1, 2]), 400)
    _error(_post(live, "/v1/completions", content="\xff".encode("latin-1")), 400)


def test_context_length_exceeded(live, client):
    long_text = "word " * 1200
    for kwargs in ({"messages": [{"role": "user", "content": long_text}]},
                   {"messages": HI, "max_tokens": 2000}):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, **{"max_tokens": 2, **kwargs})
        assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=5000)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 1024 tokens" in info.value.body["message"]


def test_unknown_model(client):
    for call in (lambda: client.chat.completions.create(model="gpt-x", messages=HI),
                 lambda: client.completions.create(model="gpt-x", prompt="hi")):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_unknown_route_and_method(live):
    assert _error(httpx.get(f"{live.url}/v1/nothing"), 404)["code"] == "not_found"
    _error(httpx.get(f"{live.url}/v1/chat/completions"), 405)


def test_internal_errors_keep_the_openai_shape(live, client):
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                                               "RAISE:"}])
    assert info.value.status_code == 500 and info.value.body["type"] == "server_error"
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "FAIL:"}],
                                       max_tokens=5)
    live.wait_idle()


def test_errors_after_the_sse_header(live, client):
    with live.client().chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "FAIL:"}], max_tokens=5,
            stream=True) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and '"error":' in events[-2]
    with pytest.raises(openai.APIError, match="generation failed"):
        list(client.chat.completions.create(model=MODEL, messages=[
            {"role": "user", "content": "FAIL:"}], max_tokens=5, stream=True))
    live.wait_idle()
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices


def test_api_key(strict_live):
    with pytest.raises(openai.AuthenticationError) as info:
        strict_live.client(api_key="wrong").models.list()
    assert info.value.body["code"] == "invalid_api_key"
    response = httpx.post(f"{strict_live.url}/v1/chat/completions", json=_chat())
    assert _error(response, 401)["type"] == "invalid_request_error"
    assert strict_live.client(api_key=API_KEY).models.list().data
    assert httpx.get(f"{strict_live.url}/health").status_code == 200


def test_full_queue_answers_503_with_retry_after(strict_live):
    client = strict_live.client(api_key=API_KEY)
    stream = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=500, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    with pytest.raises(openai.InternalServerError) as info:
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert info.value.status_code == 503 and info.value.response.headers["retry-after"] == "1"
    assert info.value.body["type"] == "server_error"
    stream.close()
    strict_live.wait_idle()
    assert client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1).choices


SURROGATES = [
    ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\udfff"], "max_tokens": 2}',
     "prompt[1]"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": '
     '"\\ud800"}], "stream": true}', "messages[0].content"),
    ("/v1/responses", '{"model": "%s", "input": "\\ud800"}', "input"),
]


@pytest.mark.parametrize("route,body,param", SURROGATES)
def test_an_unpaired_surrogate_escape_is_a_400_naming_the_field(live, route, body, param):
    """JSON escapes can write half a UTF-16 pair, which no tokenizer takes (it was a 500)."""
    response = _post(live, route, content=(body % MODEL).encode(),
                     headers={"Content-Type": "application/json"})
    assert _error(response, 400)["param"] == param


def test_deeply_nested_tool_arguments_on_any_role_are_a_400(live):
    """The template parses the arguments of every message's tool calls, not only the
    assistant's that the field checks look at."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000}}
    body = _chat(messages=[{"role": "user", "content": "hi", "tool_calls": [call]}])
    error = _error(_post(live, "/v1/chat/completions", json=body), 400)
    assert "not valid JSON" in error["message"]


def test_json_mode_check_takes_deeply_nested_output():
    """response_format json_*: the output is only checked for a debug line; nesting past the
    parser's stack must not fail the finished request."""
    request = SimpleNamespace(response_format="json_object")
    _check_json(request, "[" * 5000, [])


def test_null_template_kwarg_leaves_the_top_level_effort():
    """A JSON null is absent: chat_template_kwargs {"reasoning_effort": null} does not hide
    the top-level reasoning_effort."""
    body = Fields(_chat(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": None,
                                                                       "x": 1}), "")
    assert _template_kwargs(body) == {"reasoning_effort": "low", "x": 1}


@pytest.mark.parametrize("path,label", [
    ("/v1/responses", "/v1/responses"), ("/v1/responses/resp_1", "/v1/responses/{response_id}"),
    ("/v1/models/glm", "/v1/models/{model_id}"), ("/v1/nothing", "other")])
def test_metrics_route_labels(path, label):
    assert route_label(path) == label


def test_a_non_ascii_api_key_matches_itself():
    """The Authorization header arrives as bytes (UTF-8 from clients); the key must match
    byte for byte, not after a latin-1 decode and a UTF-8 encode."""
    key = "clé-秘密"
    middleware = ApiMiddleware(None, api_key=key, metrics=None)

    def scope(token: str) -> dict:
        return {"headers": [(b"authorization", f"Bearer {token}".encode())]}
    assert middleware._is_authorized(scope(key))
    assert not middleware._is_authorized(scope("cle-秘密"))
