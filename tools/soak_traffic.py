"""The soak's clients: what each kind of request sends and which outcomes count as right.

Valid requests (chat and completions, streamed or not) must succeed: a 503 `overloaded` is
retried after its Retry-After, anything else (an error status, an error event, a stream without
`[DONE]`, a timeout) is a lost valid request. Hostile requests (the fuzzer's) must get a 4xx;
oversized bodies a 413. Disconnects, aborts and bursts past the queue are expected behaviour and
only counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from tools.request_fuzz import RequestFuzzer

MAX_RETRIES = 30
WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "north", "quiet")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
KINDS = {  # kind: share of the traffic (hostile kinds sum to 0.10 at --hostile 0.1)
    "chat": 0.20, "chat_stream": 0.25, "completion": 0.13, "completion_stream": 0.15,
    "disconnect": 0.06, "abort": 0.04, "burst": 0.02, "hostile": 0.08, "oversized": 0.02,
}
HOSTILE_KINDS = ("hostile", "oversized")
VALID_KINDS = ("chat", "chat_stream", "completion", "completion_stream")


@dataclass
class Tally:
    """Outcomes by (kind, outcome), latencies of valid requests, and a few failure examples."""

    outcomes: Counter = field(default_factory=Counter)
    actions: Counter = field(default_factory=Counter)
    """Client actions by kind (a burst is one action of many requests)."""
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        self.outcomes[(kind, outcome)] += 1
        if outcome in ("LOST", "NOT_4XX") and len(self.failures) < 20:
            self.failures.append(f"{kind}: {outcome}: {detail[:300]}")

    def count(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.outcomes.items() if o == outcome)


class Traffic:
    """One client's requests against `url` (the soak runs many of these concurrently)."""

    def __init__(self, url: str, model: str, tally: Tally, seed: int, hostile: float,
                 max_request_bytes: int) -> None:
        self.url, self.model, self.tally = url, model, tally
        self.rng = random.Random(seed)
        self.fuzzer = RequestFuzzer(seed, model)
        self.max_request_bytes = max_request_bytes
        scale = hostile / sum(KINDS[k] for k in HOSTILE_KINDS)
        benign = (1 - hostile) / (1 - sum(KINDS[k] for k in HOSTILE_KINDS))
        self.weights = {k: w * (scale if k in HOSTILE_KINDS else benign) for k, w in KINDS.items()}

    async def run(self, client: httpx.AsyncClient, deadline: float) -> None:
        kinds, weights = zip(*self.weights.items(), strict=True)
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            self.tally.actions[kind] += 1
            try:
                await getattr(self, f"_{kind}")(client)
            except (httpx.HTTPError, OSError, ValueError) as exc:
                self.tally.add(kind, "LOST" if kind in VALID_KINDS else "client_error", repr(exc))

    # Valid requests.
    def _body(self, stream: bool, chat: bool) -> dict:
        rng = self.rng
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 120)))
        body = {"model": self.model, "max_tokens": rng.randint(4, 32), "stream": stream,
                "temperature": rng.choice([0, 0.7, 1.0, 1.2]), "n": rng.choice([1, 1, 1, 2])}
        if rng.random() < 0.3:
            body["seed"] = rng.randint(-(2**63), 2**63 - 1)
        if rng.random() < 0.2:
            body["logprobs"] = True if chat else 2
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
            if rng.random() < 0.2:
                body["tools"] = TOOLS
        else:
            body["prompt"] = text
        return body

    async def _chat(self, client: httpx.AsyncClient) -> None:
        await self._valid(client, "chat", "/v1/chat/completions", self._body(False, True))

    async def _chat_stream(self, client: httpx.AsyncClient) -> None:
        await self._valid(client, "chat_stream", "/v1/chat/completions", self._body(True, True))

    async def _completion(self, client: httpx.AsyncClient) -> None:
        await self._valid(client, "completion", "/v1/completions", self._body(False, False))

    async def _completion_stream(self, client: httpx.AsyncClient) -> None:
        await self._valid(client, "completion_stream", "/v1/completions", self._body(True, False))

    async def _valid(self, client: httpx.AsyncClient, kind: str, route: str, body: dict) -> None:
        start, num_503 = time.perf_counter(), 0
        while True:
            try:
                verdict, retry_after = await _send(client, self.url + route, body)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                verdict, retry_after = f"transport error {type(exc).__name__}: {exc}", None
            if retry_after is None or num_503 == MAX_RETRIES:
                break
            num_503 += 1
            await asyncio.sleep(retry_after)
        if verdict == "ok":
            self.tally.latencies.append(time.perf_counter() - start)
            self.tally.add(kind, "ok_after_503" if num_503 else "ok")
        else:
            self.tally.add(kind, "LOST", f"{verdict} | {json.dumps(body)[:200]}")

    # Expected interruptions.
    async def _disconnect(self, client: httpx.AsyncClient) -> None:
        body = {**self._body(True, True), "max_tokens": 200, "ignore_eos": True}
        try:
            async with client.stream("POST", self.url + "/v1/chat/completions",
                                     json=body) as response:
                seen = 0
                async for _ in response.aiter_lines():
                    seen += 1
                    if seen >= self.rng.randint(1, 6):
                        break
            self.tally.add("disconnect", "disconnected")
        except httpx.HTTPError as exc:
            self.tally.add("disconnect", "transport_error", repr(exc))

    async def _abort(self, client: httpx.AsyncClient) -> None:
        body = {**self._body(False, self.rng.random() < 0.5), "max_tokens": 200,
                "ignore_eos": True}
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        try:
            await client.post(self.url + route, json=body, timeout=self.rng.uniform(0.05, 0.5))
            self.tally.add("abort", "finished_first")
        except httpx.TimeoutException:
            self.tally.add("abort", "aborted")

    async def _burst(self, client: httpx.AsyncClient) -> None:
        """Many short requests at once, without retries: a 503 is the expected overflow."""
        async def one() -> str:
            body = {**self._body(False, False), "max_tokens": 2}
            response = await client.post(self.url + "/v1/completions", json=body)
            return {200: "ok", 503: "overflow_503"}.get(response.status_code, "LOST")
        for outcome in await asyncio.gather(*(one() for _ in range(24))):
            self.tally.add("burst", outcome)

    # Hostile requests.
    async def _hostile(self, client: httpx.AsyncClient) -> None:
        case = self.fuzzer.case()
        try:
            response = await client.post(self.url + case.route, content=case.body,
                                         headers={"Content-Type": "application/json"})
            status = response.status_code
        except httpx.HTTPError as exc:
            self.tally.add("hostile", "NOT_4XX", f"{case.what}: {exc!r}")
            return
        outcome = f"{status}" if 400 <= status < 500 else "NOT_4XX"
        self.tally.add("hostile", outcome, f"{case.what}: {status} {response.text[:200]}")

    async def _oversized(self, client: httpx.AsyncClient) -> None:
        """A body past --max-request-bytes, declared up front: 413 before it is read."""
        status = await _declare_oversized(self.url, self.max_request_bytes + 1)
        self.tally.add("oversized", str(status) if status == 413 else "NOT_4XX", f"{status}")


async def _send(client: httpx.AsyncClient, url: str, body: dict) -> tuple[str, float | None]:
    """'ok' or what was wrong; a retry delay when the server was overloaded."""
    if not body["stream"]:
        response = await client.post(url, json=body)
        if response.status_code == 503:
            return "503", float(response.headers.get("Retry-After", 1))
        if response.status_code != 200:
            return f"status {response.status_code}: {response.text[:200]}", None
        choices = response.json()["choices"]
        ok = len(choices) == body["n"] and all(c["finish_reason"] for c in choices)
        return ("ok" if ok else f"bad choices {choices}"), None
    async with client.stream("POST", url, json=body) as response:
        if response.status_code == 503:
            await response.aread()
            return "503", float(response.headers.get("Retry-After", 1))
        if response.status_code != 200:
            return f"status {response.status_code}", None
        events = [line async for line in response.aiter_lines() if line]
    return _check_stream(events, body["n"]), None


def _check_stream(events: list[str], n: int) -> str:
    if not events or events[-1] != "data: [DONE]":
        return f"stream ended without [DONE]: {events[-2:]}"
    finished = set()
    for event in events[:-1]:
        payload = json.loads(event.removeprefix("data: "))
        if "error" in payload:
            return f"error event {payload['error']}"
        finished |= {c["index"] for c in payload["choices"] if c.get("finish_reason")}
    return "ok" if len(finished) == n else f"{len(finished)} of {n} choices finished"


async def _declare_oversized(url: str, num_bytes: int) -> int:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                     f"application/json\r\nContent-Length: {num_bytes}\r\n\r\n{{".encode())
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split()[1])
    except (OSError, ValueError, IndexError, asyncio.TimeoutError):
        return 0
    finally:
        writer.close()
