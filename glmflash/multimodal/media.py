"""Where request media come from and what a request may carry.

Sources are `data:` URLs, http(s) URLs (fetched with a deadline and a byte cap, never from a
private address unless allowed: fetch.py) and, when a local root is configured, local paths or
`file://` URLs under it. Anything unreadable, too large or
not decodable raises `MediaError`, a `ValueError` the server maps to a 400.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import urllib.parse
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from PIL import Image, ImageOps

from glmflash.multimodal.fetch import FetchError, UrlPolicy, http_get
from glmflash.multimodal.image import PIXELS_PER_TOKEN, ImageProcessConfig
from glmflash.multimodal.video import (
    VideoDecodeError,
    VideoFrames,
    VideoProcessConfig,
    decode_video,
)

logger = logging.getLogger(__name__)


class MediaError(ValueError):
    """Media that cannot be fetched, is too large, or cannot be decoded."""


@dataclass(frozen=True)
class MediaLimits:
    """Media per request; images and a video never come together."""

    max_images: int = 8
    max_videos: int = 1

    @classmethod
    def from_dict(cls, raw: dict[str, int]) -> MediaLimits:
        """`{"image": 8, "video": 1}` (the `--limit-mm-per-prompt` form)."""
        unknown = set(raw) - {"image", "video"}
        if unknown:
            raise ValueError(f"unknown media kinds {sorted(unknown)}; expected 'image', 'video'")
        return cls(max_images=int(raw.get("image", cls.max_images)),
                   max_videos=int(raw.get("video", cls.max_videos)))

    def check(self, num_images: int, num_videos: int) -> None:
        if num_images and num_videos:
            raise MediaError(f"a request may carry images or a video, not both (got {num_images} "
                             f"images and {num_videos} videos)")
        if num_images > self.max_images:
            raise MediaError(f"at most {self.max_images} images per request, got {num_images}")
        if num_videos > self.max_videos:
            raise MediaError(f"at most {self.max_videos} videos per request, got {num_videos}")


@dataclass(frozen=True)
class MultimodalProcessConfig:
    """Per-modality preprocessing budgets (the `--mm-process-config` JSON)."""

    image: ImageProcessConfig = ImageProcessConfig()
    video: VideoProcessConfig = VideoProcessConfig()

    @classmethod
    def from_dict(cls, raw: dict[str, dict[str, Any]] | None) -> MultimodalProcessConfig:
        """`{"image": {"max_pixels": ...}, "video": {"fps": 2, "max_frames": ...}}`; token budgets
        (`min_image_tokens`/`max_image_tokens`, the reference's names) are also accepted."""
        raw = raw or {}
        unknown = set(raw) - {"image", "video"}
        if unknown:
            raise ValueError(f"unknown modalities {sorted(unknown)}; expected 'image', 'video'")
        return cls(image=_modality(ImageProcessConfig, raw.get("image") or {}),
                   video=_modality(VideoProcessConfig, raw.get("video") or {}))


def _modality(cls: type, raw: dict[str, Any]):
    kwargs = dict(raw)
    for tokens, pixels in (("min_image_tokens", "min_pixels"), ("max_image_tokens", "max_pixels")):
        if tokens in kwargs:
            kwargs[pixels] = int(kwargs.pop(tokens)) * PIXELS_PER_TOKEN
    names = {f.name for f in fields(cls)}
    unknown = set(kwargs) - names
    if unknown:
        raise ValueError(f"unknown {cls.__name__} keys {sorted(unknown)}; expected {sorted(names)}"
                         " or min_image_tokens/max_image_tokens")
    return cls(**kwargs)


@dataclass(frozen=True)
class FetchConfig:
    timeout_s: float = 10.0
    """Deadline for one http(s) fetch, connection and body together."""
    max_image_bytes: int = 32 << 20
    max_video_bytes: int = 512 << 20
    max_image_pixels: int = 89_478_485
    """Decoded pixels above this are refused (PIL's decompression-bomb threshold)."""
    max_video_decoded_bytes: int = 16 << 30
    """RGB bytes of the sampled frames at their original size (checked before decoding)."""
    local_root: Path | None = None
    """Local paths and file:// URLs are served only under this folder; None refuses them."""
    url_policy: UrlPolicy = UrlPolicy()
    """Which http(s) hosts may be fetched (public addresses only, by default)."""


def fetch_bytes(source: str, *, max_bytes: int, config: FetchConfig) -> bytes:
    """The bytes of a data URL or an http(s) URL (local paths: see `local_path`)."""
    if source.startswith("data:"):
        return _data_url_bytes(source, max_bytes)
    if _is_remote(source):
        return _http_bytes(source, max_bytes, config)
    return _read_local(local_path(source, config), max_bytes)


def local_path(source: str, config: FetchConfig) -> Path:
    """Resolve a path or file:// URL, refusing it outside `config.local_root`."""
    parts = urllib.parse.urlsplit(source)
    if parts.scheme not in ("", "file"):
        raise MediaError(f"unsupported media URL scheme {parts.scheme!r} (use data:, http(s):, "
                         "or a local path)")
    if config.local_root is None:
        raise MediaError("local media paths are disabled on this server")
    raw = urllib.parse.unquote(parts.path) if parts.scheme == "file" else source
    path = Path(raw).expanduser().resolve()
    root = Path(config.local_root).resolve()
    if not path.is_relative_to(root):
        raise MediaError(f"local media path {raw!r} is outside the allowed folder {root}")
    if not path.is_file():
        raise MediaError(f"local media file {raw!r} does not exist")
    return path


def _data_url_bytes(url: str, max_bytes: int) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise MediaError("malformed data URL: no ',' after the media type")
    if header.endswith(";base64"):
        if len(payload) * 3 // 4 > max_bytes + 3:
            raise MediaError(f"data URL media exceeds the {max_bytes}-byte limit")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise MediaError(f"data URL is not valid base64 ({exc})") from exc
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > max_bytes:
        raise MediaError(f"data URL media is {len(data)} bytes, over the {max_bytes}-byte limit")
    return data


def _http_bytes(url: str, max_bytes: int, config: FetchConfig) -> bytes:
    try:
        body = http_get(url, max_bytes=max_bytes, timeout_s=config.timeout_s,
                        policy=config.url_policy)
    except FetchError as exc:
        raise MediaError(str(exc)) from None
    logger.debug("fetched %d bytes from %s", len(body), url)
    return body


def _read_local(path: Path, max_bytes: int) -> bytes:
    size = path.stat().st_size
    if size > max_bytes:
        raise MediaError(f"{path.name}: {size} bytes, over the {max_bytes}-byte limit")
    return path.read_bytes()


def load_image(source: str | bytes, config: FetchConfig) -> Image.Image:
    """Fetch and fully decode one image (mode kept; preprocessing converts to RGB)."""
    data = source if isinstance(source, bytes) else \
        fetch_bytes(source, max_bytes=config.max_image_bytes, config=config)
    if len(data) > config.max_image_bytes:
        raise MediaError(f"image is {len(data)} bytes, over the {config.max_image_bytes}-byte "
                         "limit")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > config.max_image_pixels:
                raise MediaError(f"image is {width}x{height}, over the {config.max_image_pixels}"
                                 "-pixel limit")
            image.load()
            # Upright as the camera saw it, as the reference's loader turns it (EXIF).
            image = ImageOps.exif_transpose(image)
    except MediaError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise MediaError(f"cannot decode the image ({exc})") from exc
    return image


def load_video(source: str | bytes, config: FetchConfig,
               process: VideoProcessConfig) -> VideoFrames:
    """Fetch, decode and sample one video; local files are decoded in place."""
    data: str | bytes
    if isinstance(source, bytes) or _is_remote(source):
        data = source if isinstance(source, bytes) else \
            fetch_bytes(source, max_bytes=config.max_video_bytes, config=config)
        if len(data) > config.max_video_bytes:
            raise MediaError(f"video is {len(data)} bytes, over the {config.max_video_bytes}-byte "
                             "limit")
    else:
        path = local_path(source, config)
        if path.stat().st_size > config.max_video_bytes:
            raise MediaError(f"{path.name}: over the {config.max_video_bytes}-byte limit")
        data = str(path)
    try:
        return decode_video(data, process, max_decoded_bytes=config.max_video_decoded_bytes)
    except VideoDecodeError as exc:
        raise MediaError(str(exc)) from exc


def _is_remote(source: str) -> bool:
    return source.startswith("data:") or urllib.parse.urlsplit(source).scheme in ("http", "https")
