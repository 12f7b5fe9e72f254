"""Images and video through the server: two images or one video get an answer; every request
boundary violation is a 400 that harms no other request."""

from __future__ import annotations

import base64
import io

import httpx
import pytest

from tests.multimodal.conftest import make_video, random_image
from tests.server.conftest import MODEL


def _image_url(seed: int, height: int, width: int) -> dict:
    buf = io.BytesIO()
    random_image(seed, height, width).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def _video_url(tmp_path) -> dict:
    path = make_video(tmp_path / "clip.mp4", num_frames=12, fps=6, height=56, width=56)
    url = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    return {"type": "video_url", "video_url": {"url": url}}


def _chat(live, parts: list[dict], stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"},
                                                       *parts]}]}
    return httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60)


def test_two_images_get_an_answer(live):
    response = _chat(live, [_image_url(1, 60, 80), _image_url(2, 90, 40)])
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["usage"]["completion_tokens"] == 3
    image_id = live.engine.tokenizer.token_to_id("<|image|>")
    assert live.hook.prepared[-1].prompt_token_ids[0].count(image_id) > 2


def test_one_video_streams_an_answer(live, tmp_path):
    response = _chat(live, [_video_url(tmp_path)], stream=True)
    assert response.status_code == 200, response.text
    assert response.text.rstrip().endswith("data: [DONE]")
    assert '"finish_reason":"length"' in response.text.replace(" ", "")


@pytest.mark.parametrize("kind", ["image_and_video", "two_videos", "nine_images"])
def test_boundaries_are_400_and_leave_the_server_well(live, tmp_path, kind):
    video = _video_url(tmp_path)
    parts = {"image_and_video": [_image_url(3, 40, 40), video],
             "two_videos": [video, video],
             "nine_images": [_image_url(i, 30, 30) for i in range(9)]}[kind]
    response = _chat(live, parts)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "invalid_media"
    assert _chat(live, [_image_url(4, 40, 40)]).status_code == 200
    assert live.engine.cache.num_free_pages == live.engine.cache.plan.num_pages
