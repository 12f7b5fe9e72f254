"""Media sources (data URL, local path, http) and their failure modes; per-request limits."""

from __future__ import annotations

import base64
import io
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from glmflash.multimodal import (
    FetchConfig,
    MediaError,
    MediaLimits,
    VideoProcessConfig,
    decode_video,
    load_image,
    load_video,
)
from glmflash.multimodal.fetch import UrlPolicy
from tests.multimodal.conftest import make_video, random_image

# The test server listens on 127.0.0.1, a private address the default policy refuses.
LOOPBACK = UrlPolicy(allow_private=True)


def _png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


class _Handler(SimpleHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            time.sleep(1.5)
        if self.path == "/stream":
            # No Content-Length: the size limit must act while reading.
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"x" * 5000)
            return
        super().do_GET()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "cat.png").write_bytes(_png_bytes(random_image(0, 40, 60)))
    (root / "broken.png").write_bytes(_png_bytes(random_image(1, 40, 60))[:200])
    make_video(root / "clip.mp4", num_frames=12, fps=6, height=40, width=60)
    _write_wav(root / "tone.wav")
    return root


def _write_wav(path) -> None:
    av = pytest.importorskip("av")
    with av.open(str(path), "w", format="wav") as container:
        stream = container.add_stream("pcm_s16le", rate=8000, layout="mono")
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16",
                                           layout="mono")
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())


@pytest.fixture(scope="module")
def server(media_dir):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), partial(_Handler, directory=str(media_dir)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_image_from_data_url_path_and_http(media_dir, server):
    expected = np.asarray(random_image(0, 40, 60).convert("RGBA"))
    config = FetchConfig(local_root=media_dir, url_policy=LOOPBACK)
    sources = [_data_url((media_dir / "cat.png").read_bytes()), str(media_dir / "cat.png"),
               (media_dir / "cat.png").as_uri(), f"{server}/cat.png"]
    for source in sources:
        assert np.array_equal(np.asarray(load_image(source, config).convert("RGBA")), expected)


def test_video_from_data_url_path_and_http(media_dir, server):
    config = FetchConfig(local_root=media_dir, url_policy=LOOPBACK)
    process = VideoProcessConfig()
    expected = decode_video(media_dir / "clip.mp4", process)
    data = (media_dir / "clip.mp4").read_bytes()
    for source in [_data_url(data, "video/mp4"), str(media_dir / "clip.mp4"),
                   f"{server}/clip.mp4", data]:
        video = load_video(source, config, process)
        assert video.frame_indices == expected.frame_indices == [0, 3, 6, 9]
        assert np.array_equal(video.frames, expected.frames)


def test_http_errors(server):
    with pytest.raises(MediaError, match="timed out after 0.3 s"):
        load_image(f"{server}/slow", FetchConfig(timeout_s=0.3, url_policy=LOOPBACK))
    with pytest.raises(MediaError, match="HTTP 404"):
        load_image(f"{server}/missing.png", FetchConfig(url_policy=LOOPBACK))
    with pytest.raises(MediaError, match="over the 100-byte limit"):
        load_image(f"{server}/cat.png", FetchConfig(max_image_bytes=100, url_policy=LOOPBACK))
    with pytest.raises(MediaError, match="more than the 1000-byte limit"):
        load_image(f"{server}/stream", FetchConfig(max_image_bytes=1000, url_policy=LOOPBACK))
    with pytest.raises(MediaError, match="could not be fetched"):
        load_image("http://127.0.0.1:9/x.png", FetchConfig(timeout_s=2, url_policy=LOOPBACK))


def test_corrupt_media(media_dir):
    config = FetchConfig(local_root=media_dir)
    with pytest.raises(MediaError, match="cannot decode the image"):
        load_image(b"definitely not an image", config)
    with pytest.raises(MediaError, match="cannot decode the image"):
        load_image(str(media_dir / "broken.png"), config)
    with pytest.raises(MediaError, match="not valid base64"):
        load_image("data:image/png;base64,@@@", config)
    with pytest.raises(MediaError, match="malformed data URL"):
        load_image("data:image/png;base64", config)
    with pytest.raises(MediaError, match="cannot decode the video"):
        load_video(b"\x00" * 4096, config, VideoProcessConfig())
    with pytest.raises(MediaError, match="no video stream"):
        load_video(str(media_dir / "tone.wav"), config, VideoProcessConfig())


def test_oversized_media(media_dir):
    png = (media_dir / "cat.png").read_bytes()
    with pytest.raises(MediaError, match="100-byte limit"):
        load_image(_data_url(png), FetchConfig(max_image_bytes=100))
    with pytest.raises(MediaError, match="100-byte limit"):
        load_image(str(media_dir / "cat.png"), FetchConfig(max_image_bytes=100,
                                                           local_root=media_dir))
    with pytest.raises(MediaError, match="over the 1000-pixel limit"):
        load_image(png, FetchConfig(max_image_pixels=1000))
    with pytest.raises(MediaError, match="byte limit"):
        load_video(str(media_dir / "clip.mp4"), FetchConfig(max_video_bytes=100,
                                                           local_root=media_dir),
                   VideoProcessConfig())
    with pytest.raises(MediaError, match="100-byte limit"):
        load_video((media_dir / "clip.mp4").read_bytes(), FetchConfig(max_video_bytes=100),
                   VideoProcessConfig())
    # 4 sampled 60x40 RGB frames are 28800 bytes.
    with pytest.raises(MediaError, match="4 sampled 60x40 frames need 28800 bytes"):
        load_video(str(media_dir / "clip.mp4"), FetchConfig(max_video_decoded_bytes=28799,
                                                           local_root=media_dir),
                   VideoProcessConfig())


def test_local_paths_are_confined(media_dir, tmp_path):
    outside = tmp_path / "secret.png"
    outside.write_bytes((media_dir / "cat.png").read_bytes())
    with pytest.raises(MediaError, match="local media paths are disabled"):
        load_image(str(media_dir / "cat.png"), FetchConfig())
    with pytest.raises(MediaError, match="outside the allowed folder"):
        load_image(str(outside), FetchConfig(local_root=media_dir))
    with pytest.raises(MediaError, match="outside the allowed folder"):
        load_image(str(media_dir / ".." / outside.parent.name / "secret.png"),
                   FetchConfig(local_root=media_dir))
    with pytest.raises(MediaError, match="does not exist"):
        load_image(str(media_dir / "nope.png"), FetchConfig(local_root=media_dir))
    with pytest.raises(MediaError, match="unsupported media URL scheme 'ftp'"):
        load_image("ftp://example.com/a.png", FetchConfig(local_root=media_dir))


def test_too_short_video(tmp_path):
    path = make_video(tmp_path / "blink.mp4", num_frames=2, fps=10, height=28, width=28)
    with pytest.raises(MediaError, match="too short to sample"):
        load_video(str(path), FetchConfig(local_root=tmp_path), VideoProcessConfig())


def test_media_limits():
    limits = MediaLimits()
    limits.check(8, 0)
    limits.check(0, 1)
    limits.check(0, 0)
    with pytest.raises(ValueError, match="at most 8 images per request, got 9"):
        limits.check(9, 0)
    with pytest.raises(ValueError, match="at most 1 videos per request, got 2"):
        limits.check(0, 2)
    with pytest.raises(ValueError, match="images or a video, not both"):
        limits.check(1, 1)
    assert MediaLimits.from_dict({"image": 2}) == MediaLimits(max_images=2, max_videos=1)
    with pytest.raises(ValueError, match="unknown media kinds"):
        MediaLimits.from_dict({"audio": 1})
