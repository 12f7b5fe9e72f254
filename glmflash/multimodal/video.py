"""Video decoding (PyAV), frame sampling and preprocessing as the reference (spec/model.md §6.8).

Frames are sampled at a target rate from the stream's frame count and average rate, resized as
one clip within a whole-clip pixel budget (uint8 antialiased bicubic, as torchvision does on the
CPU), padded, normalised and cut into tubelets of two frames.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from glmflash.config import VisionConfig
from glmflash.multimodal.image import (
    CLIP_MEAN,
    CLIP_STD,
    PIXELS_PER_TOKEN,
    content_size,
    patchify,
    smart_resize,
)


class VideoDecodeError(ValueError):
    """A video that cannot be decoded or sampled."""


@dataclass(frozen=True)
class VideoProcessConfig:
    """Sampling rate and whole-clip pixel budget (reference: 2 fps, 2048 frames, 16...240000
    tokens)."""

    fps: float = 2.0
    max_frames: int = 2048
    min_pixels: int = 16 * PIXELS_PER_TOKEN
    max_pixels: int = 240000 * PIXELS_PER_TOKEN

    def __post_init__(self) -> None:
        if self.fps <= 0 or self.max_frames < 2:
            raise ValueError(f"need fps > 0 and max_frames >= 2, got {self.fps} and "
                             f"{self.max_frames}")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels <= max_pixels, got {self.min_pixels} and "
                             f"{self.max_pixels}")


@dataclass
class VideoFrames:
    """Sampled RGB frames of one video and where they came from."""

    frames: np.ndarray
    """`[F, H, W, 3]` uint8."""
    fps: float
    """Average frame rate of the stream."""
    total_num_frames: int
    frame_indices: list[int] = field(default_factory=list)
    """Index in the stream of each row of `frames`."""

    @property
    def timestamps(self) -> list[float]:
        """Seconds of each sampled frame."""
        return [i / self.fps for i in self.frame_indices]


@dataclass
class VideoInputs:
    """All videos of one prompt, concatenated in prompt order."""

    pixel_values: torch.Tensor
    """`[N, C*T*P*P]` float32 tubelet rows."""
    grid_thw: torch.Tensor
    """`[M, 3]` int64 (temporal slices, h, w) of each video."""
    timestamps: list[list[float]]
    """Per video, the time of the first frame of each temporal slice."""
    merge_size: int

    @property
    def num_slice_tokens(self) -> list[int]:
        """Placeholder tokens of one temporal slice of each video: h*w / merge²."""
        return [h * w // self.merge_size**2 for _, h, w in self.grid_thw.tolist()]


def sample_frame_indices(total_num_frames: int, fps: float, *, target_fps: float,
                         max_frames: int, duration: float | None = None) -> list[int]:
    """Frames to keep: one per 1/target_fps seconds up to the whole second, even count."""
    duration = duration or round((total_num_frames - 1) / fps) + 1
    num_wanted = min(int(duration * target_fps), max_frames)
    if total_num_frames < num_wanted:
        indices = np.linspace(0, total_num_frames - 1, num_wanted, dtype=int).tolist()
    else:
        indices = _frames_at_interval(total_num_frames, fps, 1 / target_fps, duration,
                                      num_wanted)
    if len(indices) < num_wanted:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total_num_frames - 1, 0))
        indices = np.linspace(start, end, num_wanted, dtype=int).tolist()
    elif len(indices) > num_wanted:
        indices = np.linspace(0, total_num_frames - 1, num_wanted, dtype=int).tolist()
    unique = list(dict.fromkeys(indices))
    if len(unique) % 2:
        unique.append(unique[-1])
    return unique


def _frames_at_interval(total: int, fps: float, step: float, duration: float,
                        num_wanted: int) -> list[int]:
    """The reference's walk: the first frame at or after each multiple of `step` seconds,
    until the next time reaches the whole seconds of `duration`. It jumps from one pick to
    a few frames before the next instead of visiting every frame, and stops once past
    `num_wanted` (the caller then spaces the frames evenly instead): a frame count that a
    file's header overstates (billions) costs nothing."""
    seconds_per_frame = 1 / fps
    indices, next_time, i = [], 0.0, 0
    while i < total:
        if i * seconds_per_frame >= next_time:
            next_time += step
            indices.append(i)
            if next_time >= int(duration) or len(indices) > num_wanted:
                break
            # Frames more than two before next_time * fps fall short of it in any rounding.
            i = max(i + 1, int(next_time * fps) - 2)
        else:
            i += 1
    return indices


def decode_video(source: str | Path | bytes, config: VideoProcessConfig, *,
                 max_decoded_bytes: int | None = None) -> VideoFrames:
    """Decode a file path or encoded bytes with PyAV, keeping only the sampled frames.

    `max_decoded_bytes` bounds the RGB frames kept, checked from the stream header first.
    """
    import av

    try:
        with _open(av, source) as container:
            stream = _video_stream(container)
            rate = stream.average_rate or stream.guessed_rate
            if not rate:
                raise VideoDecodeError("the video stream has no frame rate")
            total = stream.frames or _count_frames(container, stream)
            duration = float(Fraction(total) / Fraction(rate))
            indices = sample_frame_indices(total, float(rate), target_fps=config.fps,
                                           max_frames=config.max_frames, duration=duration)
            if not indices:
                raise VideoDecodeError(f"the video is too short to sample ({total} frames at "
                                       f"{float(rate):g} fps)")
            decoded_bytes = len(indices) * stream.width * stream.height * 3
            if max_decoded_bytes is not None and decoded_bytes > max_decoded_bytes:
                raise VideoDecodeError(f"{len(indices)} sampled {stream.width}x{stream.height} "
                                       f"frames need {decoded_bytes} bytes, over the "
                                       f"{max_decoded_bytes}-byte limit")
            frames = _decode_indices(container, stream, indices)
    except av.FFmpegError as exc:
        raise VideoDecodeError(f"cannot decode the video: {exc}") from exc
    # A duplicated index (the even-count padding) repeats the decoded frame.
    return VideoFrames(frames=frames, fps=float(rate), total_num_frames=total,
                       frame_indices=indices)


def _open(av, source: str | Path | bytes):
    return av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source))


def _video_stream(container):
    if not container.streams.video:
        raise VideoDecodeError("the file has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # a damaged stream description: no decoder, no size
        raise VideoDecodeError("the video stream's codec is unknown or damaged")
    return stream


def _count_frames(container, stream) -> int:
    """Decode once to count frames when the container does not store the count."""
    total = sum(1 for _ in container.decode(stream))
    container.seek(0)
    return total


def _decode_indices(container, stream, indices: list[int]) -> np.ndarray:
    wanted, last, kept = set(indices), indices[-1], {}
    for i, frame in enumerate(container.decode(stream)):
        if i > last:
            break
        if i in wanted:
            kept[i] = frame.to_ndarray(format="rgb24")
    missing = sorted(wanted - kept.keys())
    if missing:
        raise VideoDecodeError(f"the video ended before frame {missing[0]} (header says "
                               f"{stream.frames} frames)")
    return np.stack([kept[i] for i in indices])


def process_video(video: VideoFrames, config: VideoProcessConfig,
                  vision: VisionConfig) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One sampled clip -> (tubelet rows `[t*h*w, C*T*P*P]`, grid (t, h, w))."""
    frames = torch.from_numpy(np.ascontiguousarray(video.frames)).permute(0, 3, 1, 2)
    num_frames, _, height, width = frames.shape
    p, m, tp = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    canvas = smart_resize(num_frames, height, width, factor=p * m, temporal_factor=tp,
                          min_pixels=config.min_pixels, max_pixels=config.max_pixels)
    content = content_size(num_frames, height, width, canvas, config.min_pixels)
    if content != (height, width):
        # uint8 in, uint8 out: the CPU kernel torchvision's resize dispatches to.
        frames = torch.nn.functional.interpolate(frames.contiguous(), size=content,
                                                 mode="bicubic", align_corners=False,
                                                 antialias=True)
    frames = torch.nn.functional.pad(frames, (0, canvas[1] - content[1], 0, canvas[0] - content[0]))
    if num_frames % tp:
        frames = torch.cat([frames, frames[-1:].expand(tp - num_frames % tp, -1, -1, -1)])
    mean = torch.tensor(CLIP_MEAN) * 255.0
    std = torch.tensor(CLIP_STD) * 255.0
    frames = (frames.float() - mean[:, None, None]) / std[:, None, None]
    grid = (frames.shape[0] // tp, canvas[0] // p, canvas[1] // p)
    return patchify(frames, p, m, tp), grid


def process_videos(videos: list[VideoFrames], config: VideoProcessConfig,
                   vision: VisionConfig) -> VideoInputs:
    """All videos of a prompt -> concatenated tubelet rows, grids and slice timestamps."""
    if not videos:
        raise ValueError("process_videos needs at least one video")
    rows, grids = zip(*(process_video(video, config, vision) for video in videos), strict=True)
    # Slice k starts at sampled frame 2k; the count can fall short only for odd frame lists.
    timestamps = []
    for video, (t, _, _) in zip(videos, grids, strict=True):
        starts = video.timestamps[::vision.temporal_patch_size][:t]
        timestamps.append(starts + [starts[-1] if starts else 0.0] * (t - len(starts)))
    return VideoInputs(pixel_values=torch.cat(rows), grid_thw=torch.tensor(grids),
                       timestamps=timestamps, merge_size=vision.spatial_merge_size)

