"""Through the server: image URLs into the private network (loopback, 10.x, the cloud metadata
address, or a redirect to them) are 400 invalid_media that name no internal detail."""

from __future__ import annotations

import httpx
import pytest

from tests.multimodal.fake_net import HOSTS
from tests.server.conftest import MODEL


def _chat_with_image(live, url: str) -> httpx.Response:
    content = [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:{port}/tiny.png", "http://10.0.0.7/cat.png",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://metadata.example/latest/meta-data/", "http://[::1]:{port}/tiny.png",
    "http://media.example/to?http://169.254.169.254/latest/meta-data/",
    "http://media.example/to?http://10.0.0.7/cat.png",
    "http://media.example/to?http://127.0.0.1:{port}/tiny.png",
])
def test_media_urls_into_the_network_are_refused(live, fake_net, url):
    response = _chat_with_image(live, url.format(port=fake_net.port))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_media" and "not a public address" in error["message"]
    assert "Errno" not in error["message"]
    assert not any(a in error["message"] for a in HOSTS.values() if a not in url)
    assert fake_net.refused == []


def test_a_public_media_url_is_answered(live, fake_net):
    response = _chat_with_image(live, "http://media.example/tiny.png")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


def test_media_url_flags_reach_the_engine():
    from glmflash.server.args import build_parser, engine_options

    args = build_parser().parse_args(["--allowed-media-domains", "cdn.example", "img.example",
                                      "--allow-private-media-urls"])
    options = engine_options(args)
    assert options["allowed_media_domains"] == ["cdn.example", "img.example"]
    assert options["allow_private_media_urls"] is True
    assert "allow_private_media_urls" not in engine_options(build_parser().parse_args([]))
