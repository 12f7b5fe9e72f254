"""The request-schema fuzzer (tools/request_fuzz.py): a bounded number of hostile requests, each
answered 4xx, with the server healthy and its cache free afterwards."""

from __future__ import annotations

import httpx

from tests.server.conftest import MODEL
from tools.request_fuzz import RequestFuzzer

NUM_CASES = 300


def test_every_hostile_request_is_a_4xx(live):
    fuzzer = RequestFuzzer(seed=20261201, model=MODEL)
    bad = []
    with httpx.Client(timeout=60) as client:
        for _ in range(NUM_CASES):
            case = fuzzer.case()
            response = client.post(f"{live.url}{case.route}", content=case.body,
                                   headers={"Content-Type": "application/json"})
            if not 400 <= response.status_code < 500:
                bad.append((case.what, response.status_code, response.text[:200]))
            else:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert not bad, bad[:5]
    assert httpx.get(f"{live.url}/health").status_code == 200
    live.wait_idle()
    live.engine.check_integrity()
