"""The engine's media stage: image and video sources (from chat messages, or as the server parsed
them) loaded, checked and preprocessed on the caller's thread, the prompt's placeholders expanded.
The model embeds the result on the engine thread (model/media.py)."""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from glmflash.config import ModelConfig
from glmflash.multimodal.fetch import UrlPolicy
from glmflash.multimodal.media import (
    FetchConfig,
    MediaError,
    MediaLimits,
    MultimodalProcessConfig,
    load_image,
    load_video,
)
from glmflash.multimodal.prompt import MultimodalPrompt, prepare_multimodal_prompt

IMAGE_PARTS = ("image_url", "image")
VIDEO_PARTS = ("video_url", "video")


@dataclass
class MediaSources:
    images: list[str]
    videos: list[str]

    def __bool__(self) -> bool:
        return bool(self.images or self.videos)


def collect_media(messages: list[dict[str, Any]]) -> MediaSources:
    """Image and video sources in the order the chat template renders their placeholders."""
    sources = MediaSources([], [])
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in IMAGE_PARTS:
                sources.images.append(_source(part, kind))
            elif kind in VIDEO_PARTS:
                sources.videos.append(_source(part, kind))
    return sources


def _source(part: dict[str, Any], kind: str) -> str:
    value = part.get(kind)
    if isinstance(value, dict):
        value = value.get("url")
    if not isinstance(value, str) or not value:
        raise MediaError(f"a {kind} content part needs a url")
    return value


class MediaPreparer:
    """Turns a rendered prompt plus media sources into the expanded prompt and pixel inputs."""

    def __init__(self, config: ModelConfig, tokenizer, *, limits: dict | None = None,
                 process: dict | None = None, local_root: str | None = None,
                 url_policy: UrlPolicy | None = None) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.limits = MediaLimits.from_dict(limits or {})
        self.process = MultimodalProcessConfig.from_dict(process)
        self.fetch = FetchConfig(local_root=Path(local_root) if local_root else None,
                                 url_policy=url_policy or UrlPolicy())

    def prepare(self, token_ids: list[int], sources: MediaSources) -> MultimodalPrompt:
        """Fetch, check and preprocess; every problem with the media is a MediaError."""
        try:
            return self._prepare(token_ids, sources)
        except MediaError:
            raise
        except ValueError as exc:
            raise MediaError(str(exc)) from exc

    def _prepare(self, token_ids: list[int], sources: MediaSources) -> MultimodalPrompt:
        self.limits.check(len(sources.images), len(sources.videos))
        if self.config.vision is None:
            raise MediaError("this model has no vision tower; images and video are not supported")
        images = [load_image(s, self.fetch) for s in sources.images]
        videos = [load_video(s, self.fetch, self.process.video) for s in sources.videos]
        return prepare_multimodal_prompt(token_ids, config=self.config, tokenizer=self.tokenizer,
                                         images=images, videos=videos, process=self.process)


def media_cache_key(token_ids: list[int], embeds: torch.Tensor, media_token_id: int) -> array:
    """The prefix-cache key of a multimodal prompt: its token ids with every run of media
    placeholders replaced by a hash of the features the model sees there (negative, so never a
    token id): prompts with other images diverge at the first placeholder of the first image
    that differs; the same image in the same place matches."""
    key = array("q", token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    is_media = np.concatenate([[False], ids == media_token_id, [False]])
    edges = np.flatnonzero(is_media[1:] != is_media[:-1])
    rows = embeds.detach()
    for start, end in zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True):
        run = rows[start:end].float().cpu().numpy().tobytes()
        digest = int.from_bytes(hashlib.blake2b(run, digest_size=8).digest(), "little")
        key[start:end] = array("q", [-1 - (digest >> 2)] * (end - start))
    return key
