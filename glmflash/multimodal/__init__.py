"""Images and video: loading, preprocessing as the reference processors and prompt expansion
(spec/model.md §6); the model merges the vision features (model/media.py)."""

from glmflash.multimodal.image import ImageInputs, ImageProcessConfig, process_images
from glmflash.multimodal.media import (
    FetchConfig,
    MediaError,
    MediaLimits,
    MultimodalProcessConfig,
    load_image,
    load_video,
)
from glmflash.multimodal.prompt import (
    MediaTokenIds,
    MultimodalPrompt,
    expand_media_tokens,
    prepare_multimodal_prompt,
)
from glmflash.multimodal.video import (
    VideoFrames,
    VideoInputs,
    VideoProcessConfig,
    decode_video,
    process_videos,
)

__all__ = [
    "FetchConfig", "ImageInputs", "ImageProcessConfig", "MediaError", "MediaLimits",
    "MediaTokenIds", "MultimodalProcessConfig", "MultimodalPrompt", "VideoFrames", "VideoInputs",
    "VideoProcessConfig", "decode_video", "expand_media_tokens",
    "load_image", "load_video", "prepare_multimodal_prompt", "process_images", "process_videos",
]
