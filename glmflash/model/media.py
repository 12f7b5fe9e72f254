"""The model's side of images and video: which tokens are visual, and the prompt embeddings with
the vision tower's features merged in (spec/model.md §6.5). Preprocessing (pixels, placeholder
expansion) is the multimodal package's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from glmflash.config import ModelConfig

if TYPE_CHECKING:
    from glmflash.model.vision import VisionTower
    from glmflash.multimodal.image import ImageInputs
    from glmflash.multimodal.video import VideoInputs


@dataclass(frozen=True)
class MediaTokenIds:
    image: int
    video: int
    image_start: int
    image_end: int
    video_start: int
    video_end: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> MediaTokenIds:
        return cls(image=config.image_token_id, video=config.video_token_id,
                   image_start=config.image_start_token_id, image_end=config.image_end_token_id,
                   video_start=config.video_start_token_id, video_end=config.video_end_token_id)


def media_masks(token_ids: torch.Tensor, media: MediaTokenIds
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(image mask, video mask) `[T]`: `<|image|>` outside / inside a video span."""
    is_media = token_ids == media.image
    in_video = (token_ids == media.video_start).cumsum(0) > (token_ids == media.video_end).cumsum(0)
    return is_media & ~in_video, is_media & in_video


def check_media_tokens(token_ids: torch.Tensor, media: MediaTokenIds,
                       image_inputs: ImageInputs | None, video_inputs: VideoInputs | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """`media_masks`, having checked that they hold as many tokens as the images and videos
    have features (ValueError otherwise: e.g. a video marker written in a message's text
    makes the image tokens after it video tokens)."""
    image_mask, video_mask = media_masks(token_ids, media)
    num_image = sum(image_inputs.num_tokens) if image_inputs is not None else 0
    checks = (("image", image_mask, num_image),
              ("video", video_mask, _num_video_tokens(video_inputs)))
    for kind, mask, expected in checks:
        if int(mask.sum()) != expected:
            raise ValueError(f"{kind} features and {kind} tokens do not match: "
                             f"{int(mask.sum())} tokens, {expected} features (is a media "
                             "marker written in the text?)")
    return image_mask, video_mask


def embed_multimodal(model_embed_fn: Callable[[torch.Tensor], torch.Tensor],
                     vision_tower: VisionTower, token_ids: Sequence[int] | torch.Tensor,
                     image_inputs: ImageInputs | None, video_inputs: VideoInputs | None, *,
                     media: MediaTokenIds) -> torch.Tensor:
    """Token embeddings `[T, D]` with visual features on the expanded placeholder tokens.

    The tower runs once over all images and videos; image features go, in order, to the
    `<|image|>` tokens outside video spans, video features to those inside.
    """
    device = next(vision_tower.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    embeds = model_embed_fn(ids)
    image_mask, video_mask = check_media_tokens(ids, media, image_inputs, video_inputs)
    parts = [x for x in (image_inputs, video_inputs) if x is not None]
    if not parts:
        return embeds
    features = vision_tower(torch.cat([x.pixel_values for x in parts]).to(device),
                            torch.cat([x.grid_thw for x in parts])).to(embeds.dtype)
    embeds = embeds.clone()
    num_image = sum(image_inputs.num_tokens) if image_inputs is not None else 0
    embeds[image_mask] = features[:num_image]
    embeds[video_mask] = features[num_image:]
    return embeds


def _num_video_tokens(videos: VideoInputs | None) -> int:
    if videos is None:
        return 0
    return sum(t * n for (t, _, _), n in zip(videos.grid_thw.tolist(), videos.num_slice_tokens,
                                                 strict=True))
