"""Image preprocessing exactly as the reference PIL processor (spec/model.md §6.7).

RGB (alpha over white) -> aligned canvas within a pixel budget -> bicubic resize of the content
(never upscaled once the minimum budget is met) -> zero pad right/bottom -> CLIP normalisation ->
patch rows ordered by 2x2 merge window, the single frame duplicated into both temporal slots.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from glmflash.config import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Pixels per visual token at the release geometry: 2 frames x (14 * 2)^2.
PIXELS_PER_TOKEN = 2 * 28 * 28


@dataclass(frozen=True)
class ImageProcessConfig:
    """Pixel budget of one image, counted as 2 frames (reference: 16...8000 tokens)."""

    min_pixels: int = 16 * PIXELS_PER_TOKEN
    max_pixels: int = 8000 * PIXELS_PER_TOKEN

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and "
                             f"{self.max_pixels}")


@dataclass
class ImageInputs:
    """All images of one prompt, concatenated in prompt order."""

    pixel_values: torch.Tensor
    """`[N, C*T*P*P]` float32 patch rows."""
    grid_thw: torch.Tensor
    """`[M, 3]` int64 (t=1, h, w) patch grid of each image."""
    merge_size: int

    @property
    def num_tokens(self) -> list[int]:
        """Placeholder tokens of each image: t*h*w / merge²."""
        return [t * h * w // self.merge_size**2 for t, h, w in self.grid_thw.tolist()]


def smart_resize(num_frames: int, height: int, width: int, *, factor: int,
                 temporal_factor: int, min_pixels: float, max_pixels: float) -> tuple[int, int]:
    """The `factor`-aligned canvas (height, width) within [min_pixels, max_pixels] for the clip."""
    frames = max(temporal_factor, round(num_frames / temporal_factor) * temporal_factor)
    canvas_h, canvas_w = _align(height, factor), _align(width, factor)
    if frames * canvas_h * canvas_w < min_pixels:
        scale = math.sqrt(min_pixels / (num_frames * height * width))
        canvas_h = _align(max(1, math.ceil(height * scale)), factor)
        canvas_w = _align(max(1, math.ceil(width * scale)), factor)
    if frames * canvas_h * canvas_w > max_pixels:
        canvas_h, canvas_w = _fit_budget(frames, height, width, factor, max_pixels)
    return canvas_h, canvas_w


def _align(value: int, factor: int) -> int:
    return math.ceil(value / factor) * factor


def _fit_budget(frames: int, height: int, width: int, factor: int,
                max_pixels: float) -> tuple[int, int]:
    """Binary search of the largest content height whose aligned canvas fits the budget."""
    if max_pixels < frames * factor**2:
        raise ValueError(f"max_pixels={max_pixels} is too small: one aligned patch of {frames} "
                         f"frames needs {frames * factor**2}")
    low, high, best = 1, height, (factor, factor)
    while low <= high:
        mid = (low + high) // 2
        candidate = (_align(mid, factor), _align(max(1, math.floor(width * mid / height)), factor))
        if frames * candidate[0] * candidate[1] <= max_pixels:
            best, low = candidate, mid + 1
        else:
            high = mid - 1
    return best


def content_size(num_frames: int, height: int, width: int, canvas: tuple[int, int],
                 min_pixels: float) -> tuple[int, int]:
    """Size the content is resized to inside the canvas (no upscaling above the minimum)."""
    scale = min(canvas[0] / height, canvas[1] / width)
    if num_frames * height * width >= min_pixels:
        scale = min(1.0, scale)
    return (max(1, min(canvas[0], math.floor(height * scale))),
            max(1, min(canvas[1], math.floor(width * scale))))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white (as the reference converts)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def normalize_numpy(pixels: np.ndarray) -> np.ndarray:
    """uint8 `[..., H, W, C]` -> float32 CLIP-normalised, with the reference's exact rounding."""
    x = (pixels.astype(np.float64) * (1 / 255)).astype(np.float32)
    return (x - np.array(CLIP_MEAN, dtype=np.float32)) / np.array(CLIP_STD, dtype=np.float32)


def patchify(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """`[T, C, H, W]` (T a multiple of `temporal`) -> `[T/temporal * H/p * W/p, C*temporal*p*p]`.

    Rows: (time slice, block-row, block-col, in-block row, in-block col); row content:
    (channel, frame in slice, pixel row, pixel col).
    """
    t, c, h, w = frames.shape
    gh, gw = h // patch, w // patch
    x = frames.reshape(t // temporal, temporal, c, gh // merge, merge, patch, gw // merge, merge,
                       patch)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape((t // temporal) * gh * gw, c * temporal * patch * patch)


def process_image(image: Image.Image, config: ImageProcessConfig,
                  vision: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (patch rows `[h*w, C*T*P*P]`, grid (1, h, w))."""
    rgb = to_rgb(image)
    width, height = rgb.size
    p, m, tp = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    canvas = smart_resize(tp, height, width, factor=p * m, temporal_factor=tp,
                          min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    content = content_size(tp, height, width, canvas, config.min_pixels)
    if content != (height, width):
        rgb = rgb.resize((content[1], content[0]), Image.BICUBIC)
    pixels = np.zeros((*canvas, 3), dtype=np.uint8)
    pixels[:content[0], :content[1]] = np.asarray(rgb)
    chw = torch.from_numpy(normalize_numpy(pixels)).permute(2, 0, 1)
    frames = chw.unsqueeze(0).expand(tp, -1, -1, -1)
    return patchify(frames, p, m, tp), (1, canvas[0] // p, canvas[1] // p)


def process_images(images: list[Image.Image], config: ImageProcessConfig,
                   vision: VisionConfig) -> ImageInputs:
    """All images of a prompt -> concatenated patch rows and their grids."""
    if not images:
        raise ValueError("process_images needs at least one image")
    rows, grids = zip(*(process_image(image, config, vision) for image in images), strict=True)
    return ImageInputs(pixel_values=torch.cat(rows), grid_thw=torch.tensor(grids),
                       merge_size=vision.spatial_merge_size)
