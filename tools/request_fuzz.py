"""A seeded fuzzer over the OpenAI request schema: every case it makes is invalid by construction,
so a correct server answers each with a 4xx (never a 5xx, a hang or a dropped connection).

    from tools.request_fuzz import RequestFuzzer
    case = RequestFuzzer(seed=0, model="glm").case()   # route, raw body bytes, description

A case is a valid request with one to three fields broken (wrong type, out of range, NaN or
infinite, too large for int64, malformed structure, refused media URLs), or a body that is not a
request at all (broken JSON, not an object, invalid UTF-8, nesting past any parser's depth).
Media URLs use IP literals only, so no case makes the server look a name up in DNS.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

NAN, INF = float("nan"), float("inf")
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
_WRONG_TYPES = ("7", True, [], {"a": 1})
_SAMPLING = {
    "temperature": [NAN, INF, -INF, -0.1, 2.5, 1e300, *_WRONG_TYPES],
    "top_p": [NAN, 0, -1, 1.5, INF, *_WRONG_TYPES],
    "min_p": [NAN, -0.5, 2, *_WRONG_TYPES],
    "presence_penalty": [NAN, 3, -2.5, -INF, *_WRONG_TYPES],
    "frequency_penalty": [NAN, 2.01, INF, *_WRONG_TYPES],
    "repetition_penalty": [NAN, 0, -1, 2.5, *_WRONG_TYPES],
    "max_tokens": [0, -1, 1.5, 2**64, 10**9, *_WRONG_TYPES],
    "n": [0, -3, 129, 2**70, 1.0, *_WRONG_TYPES],
    "seed": [2**63, 2**64, 2**70, -(2**63) - 1, 1.5, *_WRONG_TYPES],
    "top_k": [-2, 2**31, 2**70, 0.5, *_WRONG_TYPES],
    "stop": [["a", "b", "c", "d", "e"], [""], [1], {"x": 1}, "", 5],
    "stop_token_ids": [[-1], [2**40], ["a"], [1.5], "1", 3],
    "logit_bias": [{"x": 1}, {"5": NAN}, {"5": INF}, {"5": 101}, {"5": "a"}, {"-1": 1},
                   {"99999999": 1}, {"\u00b2": 1}, {"9" * 400: 1}, [], "a"],
    "stream": ["yes", 1, [], {}],
    "stream_options": ["x", 5, []],
    "model": ["no-such-model", 5, [], {}],
    "ignore_eos": ["no", 0, []],
    "skip_special_tokens": ["no", 1.0],
}
_CHAT_ONLY = {
    "messages": [[], "hi", [1], [{}], [{"role": "wizard", "content": "x"}],
                 [{"role": "user"}], [{"role": "user", "content": 5}],
                 [{"content": "hi"}], [{"role": "user", "content": [{"type": "text"}]}],
                 [{"role": "user", "content": [{"type": "input_audio"}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 3}]}],
                 [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}],
                 [{"role": "assistant", "tool_calls": [{"type": "function", "function": {
                     "name": "f", "arguments": "{}"}}]}],
                 [{"role": "assistant", "tool_calls": [{"id": "c", "function": {
                     "name": "f", "arguments": "{oops"}}]}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                 *[[{"role": "user", "content": [{"type": "image_url", "image_url": {
                     "url": url}}]}] for url in (
                     "file:///etc/passwd", "/etc/shadow", "http://169.254.169.254/latest/",
                     "http://127.0.0.1:1/x.png", "http://10.0.0.1/x.png", "http://[::1]/x.png",
                     "ftp://127.0.0.1/x.png", "data:image/png;base64,@@@@",
                     "data:image/png;base64,AAAA", "gopher://0.0.0.0/")]],
    "tools": [[{"type": "function"}], [{"type": "x", "function": {"name": "f"}}],
              [{"type": "function", "function": {"name": "f"}}] * 2,
              [{"type": "function", "function": {"name": "<f>"}}],
              [{"type": "function", "function": {"name": "f", "parameters": 5}}], "tools", 3],
    "tool_choice": ["sometimes", 5, {"type": "function"},
                    {"type": "function", "function": {"name": "nope"}}],
    "response_format": [{"type": "xml"}, {"type": "json_schema"}, "json", 1],
    "reasoning_effort": ["extreme", 5, []],
    "chat_template_kwargs": [{"messages": []}, {"tools": 1}, "x", 5],
    "max_completion_tokens": [0, -5, 2**64, "9"],
    "top_logprobs": [21, -1, "3"],
    "parallel_tool_calls": ["no", 3],
}
_COMPLETION_ONLY = {
    "prompt": ["", [], [[]], [1, "a"], [-1], [2**40], {"a": 1}, 5, None, [[1], "x"]],
    "suffix": ["x"],
    "logprobs": [6, -1, "2", 2**70],
    "echo": ["yes", 2],
}
_NOT_REQUESTS = [b"", b"{", b'{"model": ', b"[1, 2, 3]", b'"hello"', b"5", b"null",
                 b"\xff\xfe\x00garbage", b"<xml/>", b"{'single': 'quotes'}",
                 b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b"[" * 50_000]
_REQUIRES_LOGPROBS = {"top_logprobs"}


@dataclass(frozen=True)
class HostileCase:
    route: str
    body: bytes
    what: str
    """A short description (the fields broken), for reports."""


class RequestFuzzer:
    def __init__(self, seed: int, model: str) -> None:
        self.rng = random.Random(seed)
        self.model = model

    def case(self) -> HostileCase:
        """One hostile request (about 1 in 12 is not a request at all)."""
        rng = self.rng
        route = rng.choice((CHAT, COMPLETIONS))
        if rng.random() < 1 / 12:
            raw = rng.choice(_NOT_REQUESTS)
            return HostileCase(route, raw, f"not a request ({len(raw)} bytes)")
        body = self._valid(route)
        table = {**_SAMPLING, **(_CHAT_ONLY if route == CHAT else _COMPLETION_ONLY)}
        broken = rng.sample(sorted(table), rng.randint(1, 3))
        for name in broken:
            body[name] = rng.choice(table[name])
            if name in _REQUIRES_LOGPROBS:
                body["logprobs"] = True
        if route == COMPLETIONS and body.get("prompt", "") is None:
            del body["prompt"]
        self._decorate(body)
        return HostileCase(route, json.dumps(body).encode(), "broken " + ", ".join(broken))

    def _valid(self, route: str) -> dict[str, Any]:
        base: dict[str, Any] = {"model": self.model, "max_tokens": self.rng.randint(1, 8)}
        if route == CHAT:
            base["messages"] = [{"role": "user", "content": "fuzz " * self.rng.randint(1, 20)}]
        else:
            base["prompt"] = "fuzz " * self.rng.randint(1, 20)
        return base

    def _decorate(self, body: dict[str, Any]) -> None:
        """Fields a server must ignore or accept, around the broken ones."""
        rng = self.rng
        if rng.random() < 0.3:
            body[f"x_unknown_{rng.randint(0, 99)}"] = rng.choice([1, "a", [None], {"b": []}])
        if rng.random() < 0.2:
            body["user"] = "\u202e\u0000\udbff" if rng.random() < 0.5 else "fuzzer"
