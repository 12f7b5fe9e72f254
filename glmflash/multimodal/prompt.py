"""Media placeholders in a prompt: expansion to the model's token layout (the model merges the
visual features into the expanded prompt: model/media.py).

The chat template writes `<|begin_of_image|><|image|><|end_of_image|>` per image and
`<|begin_of_video|><|video|><|end_of_video|>` per video. Expansion (spec/model.md §6.5):
`<|image|>` -> `<|image|>` x t*h*w/4; `<|video|>` -> per temporal slice `<|begin_of_image|>` +
`<|image|>` x h*w/4 + `<|end_of_image|>` + the text "{ts:.1f} seconds". The model then sees
`<|image|>` for both kinds; a token is a video token iff it lies inside a video span.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from glmflash.config import ModelConfig
from glmflash.model.media import MediaTokenIds, check_media_tokens
from glmflash.multimodal.image import ImageInputs, process_images
from glmflash.multimodal.media import MultimodalProcessConfig
from glmflash.multimodal.video import VideoFrames, VideoInputs, process_videos

if TYPE_CHECKING:
    from PIL import Image


class TextEncoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass
class MultimodalPrompt:
    token_ids: list[int]
    """The prompt with every placeholder expanded."""
    image_inputs: ImageInputs | None
    video_inputs: VideoInputs | None


def prepare_multimodal_prompt(token_ids: Sequence[int], *, config: ModelConfig,
                              tokenizer: TextEncoder, images: Sequence[Image.Image] = (),
                              videos: Sequence[VideoFrames] = (),
                              process: MultimodalProcessConfig | None = None) -> MultimodalPrompt:
    """Preprocess the media of one prompt and expand its placeholders."""
    if (images or videos) and config.vision is None:
        raise ValueError("this model has no vision tower; images and videos are not supported")
    process = process or MultimodalProcessConfig()
    image_inputs = process_images(list(images), process.image, config.vision) if images else None
    video_inputs = process_videos(list(videos), process.video, config.vision) if videos else None
    media = MediaTokenIds.from_config(config)
    expanded = expand_media_tokens(token_ids, media, tokenizer, image_inputs, video_inputs)
    # Here, not on the engine thread: the request fails alone, as invalid media.
    check_media_tokens(torch.as_tensor(expanded, dtype=torch.long), media, image_inputs,
                       video_inputs)
    return MultimodalPrompt(expanded, image_inputs, video_inputs)


def expand_media_tokens(token_ids: Sequence[int], media: MediaTokenIds, tokenizer: TextEncoder,
                        images: ImageInputs | None = None,
                        videos: VideoInputs | None = None) -> list[int]:
    """Replace each `<|image|>` / `<|video|>` placeholder, in order, by its full token layout."""
    image_blocks = _image_blocks(media, images)
    video_blocks = _video_blocks(media, tokenizer, videos)
    out: list[int] = []
    for token in token_ids:
        if token == media.image:
            out += _next_block(image_blocks, "image", images)
        elif token == media.video:
            out += _next_block(video_blocks, "video", videos)
        else:
            out.append(token)
    for blocks, kind, inputs in ((image_blocks, "image", images), (video_blocks, "video", videos)):
        left = sum(1 for _ in blocks)
        if left:
            raise ValueError(f"the prompt has {_num_items(inputs) - left} {kind} placeholders "
                             f"but {_num_items(inputs)} {kind}s were given")
    return out


def _image_blocks(media: MediaTokenIds, images: ImageInputs | None) -> Iterator[list[int]]:
    for num_tokens in images.num_tokens if images is not None else []:
        yield [media.image] * num_tokens


def _video_blocks(media: MediaTokenIds, tokenizer: TextEncoder,
                  videos: VideoInputs | None) -> Iterator[list[int]]:
    if videos is None:
        return
    for num_tokens, times in zip(videos.num_slice_tokens, videos.timestamps, strict=True):
        block: list[int] = []
        for seconds in times:
            block += [media.image_start, *[media.image] * num_tokens, media.image_end]
            block += tokenizer.encode(f"{seconds:.1f} seconds")
        yield block


def _next_block(blocks: Iterator[list[int]], kind: str,
                inputs: ImageInputs | VideoInputs | None) -> list[int]:
    block = next(blocks, None)
    if block is None:
        raise ValueError(f"the prompt has more {kind} placeholders than the "
                         f"{_num_items(inputs)} {kind}s given")
    return block


def _num_items(inputs: ImageInputs | VideoInputs | None) -> int:
    return 0 if inputs is None else inputs.grid_thw.shape[0]
