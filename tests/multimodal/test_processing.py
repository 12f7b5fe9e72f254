"""Our image/video preprocessing and prompt expansion vs the transformers glm5_next processors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.video_utils import VideoMetadata, read_video_pyav

from glmflash.config import ModelConfig, VisionConfig
from glmflash.model.media import media_masks
from glmflash.multimodal import (
    FetchConfig,
    ImageProcessConfig,
    MediaError,
    MediaTokenIds,
    MultimodalProcessConfig,
    VideoProcessConfig,
    decode_video,
    expand_media_tokens,
    load_video,
    process_images,
    process_videos,
)
from glmflash.multimodal.video import sample_frame_indices
from glmflash.tokenizer import Tokenizer
from tests.multimodal.conftest import make_video, random_image

# Measured: every comparison below is bit-exact (max |diff| 0.0); the bound only allows for
# a different BLAS/libm summation order on other machines.
PIXEL_ATOL = 1e-6
VISION = VisionConfig()

IMAGES = {  # name: (height, width, PIL mode)
    "tiny_10x7": (10, 7, "RGB"),
    "odd_97x131": (97, 131, "RGB"),
    "huge_3000x4000": (3000, 4000, "RGB"),
    "grayscale": (57, 333, "L"),
    "rgba": (150, 200, "RGBA"),
    "gray_alpha": (64, 48, "LA"),
    "palette": (120, 90, "P"),
    "strip_28x1120": (28, 1120, "RGB"),
}
VIDEOS = {  # name: (frames, fps, height, width, max tokens of the clip or None)
    "20f_10fps": (20, 10, 90, 130, None),
    "30f_8fps_dup_last": (30, 8, 61, 47, None),
    "13f_4fps_budget": (13, 4, 200, 300, 30),
    "7f_5fps_upscaled": (7, 5, 10, 7, None),
}


def _assert_same(ours: torch.Tensor, ref) -> None:
    ref = torch.as_tensor(np.asarray(ref))
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == torch.float32
    assert (ours - ref).abs().max().item() <= PIXEL_ATOL


@pytest.mark.parametrize("name", IMAGES)
def test_image_matches_reference(name, ref_image):
    height, width, mode = IMAGES[name]
    image = random_image(len(name), height, width, mode)
    ours = process_images([image], ImageProcessConfig(), VISION)
    ref = ref_image(images=[image])
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    _assert_same(ours.pixel_values, ref["pixel_values"])
    assert ours.num_tokens == [ref_image.get_number_of_image_patches(height, width) // 4]


def test_transparent_palette_is_composited_on_white(ref_image):
    image = random_image(3, 40, 30, "P")
    image.info["transparency"] = int(np.asarray(image)[0, 0])
    ours = process_images([image], ImageProcessConfig(), VISION)
    _assert_same(ours.pixel_values, ref_image(images=[image])["pixel_values"])
    # The first pixel is transparent, hence white after compositing: (1 - mean) / std.
    assert ours.pixel_values[0, 0].item() == pytest.approx((1 - 0.48145466) / 0.26862954, abs=1e-6)


def test_an_exif_rotated_photo_is_turned_upright_as_the_reference_loads_it(ref_image):
    """A JPEG stored 120 wide x 40 tall whose EXIF says to turn it a quarter (how phones store
    portrait photos): the reference's URL and base64 loader turns it upright, and so do we."""
    import base64
    import io

    from PIL import Image

    from glmflash.multimodal import FetchConfig, load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    buffer = io.BytesIO()
    random_image(0, 40, 120).save(buffer, format="JPEG", quality=95, exif=exif.tobytes())
    url = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
    ours = process_images([load_image(url, FetchConfig())], ImageProcessConfig(), VISION)
    ref = ref_image(images=[url])
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    _assert_same(ours.pixel_values, ref["pixel_values"])


def test_several_images_concatenate_in_order(ref_image):
    images = [random_image(i, h, w) for i, (h, w) in enumerate([(90, 130), (300, 200), (33, 33)])]
    ours = process_images(images, ImageProcessConfig(), VISION)
    ref = ref_image(images=images)
    assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
    _assert_same(ours.pixel_values, ref["pixel_values"])


def test_image_budget_from_mm_process_config(ref_image):
    config = MultimodalProcessConfig.from_dict(
        {"image": {"max_pixels": 300 * 1568, "min_image_tokens": 64}})
    assert config.image == ImageProcessConfig(min_pixels=64 * 1568, max_pixels=300 * 1568)
    for height, width in [(700, 900), (20, 30), (1000, 90)]:
        image = random_image(height, height, width)
        ours = process_images([image], config.image, VISION)
        ref = ref_image(images=[image], max_image_tokens=300, min_image_tokens=64)
        assert ours.grid_thw.tolist() == ref["image_grid_thw"].tolist()
        assert 64 <= ours.num_tokens[0] <= 300
        _assert_same(ours.pixel_values, ref["pixel_values"])


def test_frame_sampling_matches_reference(ref_video):
    processor, _ = ref_video
    small = type(processor)(max_frames=16)
    for total in [*range(1, 70), 299, 300, 1001, 5000]:
        for fps in [1, 2.5, 4, 10, 23.976, 25, 29.97, 60]:
            meta = VideoMetadata(total_num_frames=total, fps=fps, duration=total / fps)
            for ref, max_frames in ((processor, 2048), (small, 16)):
                ours = sample_frame_indices(total, fps, target_fps=2, max_frames=max_frames,
                                            duration=total / fps)
                assert ours == ref.sample_frames(meta).tolist(), (total, fps, max_frames)
    assert sample_frame_indices(300, 30, target_fps=2, max_frames=2048,
                                duration=10.0) == list(range(0, 300, 15))


def _sampled_over_every_frame(total: int, fps: float, duration: float) -> list[int]:
    """The reference's sampling at 2 fps as it reads: its walk visits every frame."""
    num_wanted = min(int(duration * 2), 2048)
    if total < num_wanted:
        indices = np.linspace(0, total - 1, num_wanted, dtype=int).tolist()
    else:
        indices, next_time = [], 0.0
        for i in range(total):
            if i * (1 / fps) >= next_time:
                next_time += 0.5
                indices.append(i)
                if next_time >= int(duration):
                    break
    if len(indices) < num_wanted:
        start, end = (indices[0], indices[-1]) if indices else (0, max(total - 1, 0))
        indices = np.linspace(start, end, num_wanted, dtype=int).tolist()
    elif len(indices) > num_wanted:
        indices = np.linspace(0, total - 1, num_wanted, dtype=int).tolist()
    unique = list(dict.fromkeys(indices))
    return unique + unique[-1:] if len(unique) % 2 else unique


def test_frame_sampling_jumps_to_the_same_frames():
    """The walk that jumps between picks keeps the reference's frames, at rates and lengths
    where frame times round either way (the oracle test above covers the standard rates)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        fps = float(rng.choice([rng.uniform(0.5, 240), 30000 / 1001, 24000 / 1001, 1 / 3]))
        total = int(rng.integers(1, 20000))
        ours = sample_frame_indices(total, fps, target_fps=2, max_frames=2048,
                                    duration=total / fps)
        assert ours == _sampled_over_every_frame(total, fps, total / fps), (total, fps)


def test_an_overstated_frame_count_costs_nothing():
    """A header may claim billions of frames (one changed byte): the sampling cost follows the
    frames wanted, not the claim (the decoder then finds the frames missing)."""
    total, fps = 4_110_417_932, 30.0
    indices = sample_frame_indices(total, fps, target_fps=2, max_frames=2048,
                                   duration=total / fps)
    assert len(indices) == 2048 and indices[-1] == total - 1


def test_a_damaged_stream_description_is_a_media_error(tmp_path):
    """One flipped byte in the MP4's sample description: PyAV opens a stream with no codec,
    which has no size; a MediaError (a 400), not an AttributeError (a 500)."""
    data = make_video(tmp_path / "clip.mp4", num_frames=31, fps=30, height=32,
                      width=48).read_bytes()
    assert data.count(b"stsd") == 1
    with pytest.raises(MediaError, match="codec"):
        load_video(data.replace(b"stsd", b"\x8dtsd"), FetchConfig(), VideoProcessConfig())


@pytest.mark.parametrize("name", VIDEOS)
def test_video_matches_reference(name, ref_video, tmp_path):
    num_frames, fps, height, width, max_tokens = VIDEOS[name]
    path = make_video(tmp_path / "clip.mp4", num_frames=num_frames, fps=fps, height=height,
                      width=width)
    config = VideoProcessConfig() if max_tokens is None else \
        VideoProcessConfig(max_pixels=max_tokens * 1568)
    frames = decode_video(path, config)
    ours = process_videos([frames], config, VISION)

    processor, extra = ref_video
    all_frames, meta = _reference_decode(path)
    budget = {} if max_tokens is None else {"max_image_tokens": max_tokens}
    ref = processor(videos=[all_frames], video_metadata=[meta], do_sample_frames=True,
                    return_metadata=True, **budget, **extra)
    indices = ref["video_metadata"][0].frames_indices.tolist()
    assert frames.frame_indices == indices
    assert np.array_equal(frames.frames, all_frames[indices])
    assert frames.fps == meta.fps and frames.total_num_frames == meta.total_num_frames
    assert ours.grid_thw.tolist() == ref["video_grid_thw"].tolist()
    _assert_same(ours.pixel_values, ref["pixel_values_videos"])
    assert ours.timestamps == [ref["video_metadata"][0].timestamps[::2]]


def _reference_decode(path):
    """Every frame and the metadata, by transformers' PyAV reader.

    The clip is then sampled inside the processor (`do_sample_frames=True`), which keeps a
    repeated last index as a repeated frame, as its default torchcodec loader does. (Its PyAV
    loader would drop the repeat and count one frame less in the pixel budget.)
    """
    frames, meta = read_video_pyav(str(path), sample_indices_fn=lambda metadata: np.arange(
        metadata.total_num_frames))
    meta.frames_indices = None
    return frames, meta


def test_video_bytes_and_containers_decode_alike(tmp_path):
    """Path or bytes, and a container that stores no frame count (Matroska: counted by decoding)."""
    mp4 = make_video(tmp_path / "clip.mp4", num_frames=12, fps=6, height=40, width=60)
    mkv = make_video(tmp_path / "clip.mkv", num_frames=12, fps=6, height=40, width=60)
    decoded = [decode_video(source, VideoProcessConfig())
               for source in (mp4, mp4.read_bytes(), mkv, mkv.read_bytes())]
    for video in decoded:
        assert video.frame_indices == [0, 3, 6, 9] and video.total_num_frames == 12
        assert np.array_equal(video.frames, decoded[0].frames)


@pytest.fixture(scope="module")
def tiny(tiny_dirs):
    path = tiny_dirs["embedded"]
    return Tokenizer.from_dir(path), ModelConfig.from_hf(path)


IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
VIDEO = "<|begin_of_video|><|video|><|end_of_video|>"


def test_image_prompt_expansion_matches_reference(reference_processor, tiny):
    tokenizer, config = tiny
    text = f"[gMASK]<sop><|user|>{IMAGE}Compare with{IMAGE} please.<|assistant|><think>"
    images = [random_image(1, 90, 130), random_image(2, 300, 140, "L")]
    ref = reference_processor(text=[text], images=images)
    inputs = process_images(images, ImageProcessConfig(), config.vision)
    media = MediaTokenIds.from_config(config)
    ours = expand_media_tokens(tokenizer.encode(text), media, tokenizer, images=inputs)
    assert ours == ref["input_ids"][0]
    image_mask, video_mask = media_masks(torch.tensor(ours), media)
    assert (image_mask.long() + 2 * video_mask.long()).tolist() == ref["mm_token_type_ids"][0]
    assert int(image_mask.sum()) == sum(inputs.num_tokens)


def test_video_prompt_expansion_matches_reference(reference_processor, ref_video, tiny, tmp_path):
    tokenizer, config = tiny
    path = make_video(tmp_path / "clip.mp4", num_frames=30, fps=10, height=56, width=84)
    text = f"[gMASK]<sop><|user|>{VIDEO}What happens?<|assistant|><think>"
    frames, meta = _reference_decode(path)
    ref = reference_processor(text=[text], videos=[frames], videos_kwargs=dict(
        video_metadata=[meta], do_sample_frames=True, **ref_video[1]))
    inputs = process_videos([decode_video(path, VideoProcessConfig())], VideoProcessConfig(),
                            config.vision)
    media = MediaTokenIds.from_config(config)
    ours = expand_media_tokens(tokenizer.encode(text), media, tokenizer, videos=inputs)
    assert ours == ref["input_ids"][0]
    decoded = tokenizer.decode(ours)
    assert "<|end_of_image|>0.0 seconds<|begin_of_image|>" in decoded
    assert decoded.count("<|begin_of_image|>") == inputs.grid_thw[0, 0].item() == 3
    image_mask, video_mask = media_masks(torch.tensor(ours), media)
    assert (image_mask.long() + 2 * video_mask.long()).tolist() == ref["mm_token_type_ids"][0]


def test_placeholder_count_mismatch_is_an_error(tiny):
    tokenizer, config = tiny
    media = MediaTokenIds.from_config(config)
    inputs = process_images([random_image(0, 56, 56)] * 2, ImageProcessConfig(), config.vision)
    one = tokenizer.encode(f"hi{IMAGE}")
    with pytest.raises(ValueError, match="1 image placeholders but 2 images"):
        expand_media_tokens(one, media, tokenizer, images=inputs)
    with pytest.raises(ValueError, match="more image placeholders than the 0 images"):
        expand_media_tokens(one, media, tokenizer)
    with pytest.raises(ValueError, match="more video placeholders"):
        expand_media_tokens(tokenizer.encode(VIDEO), media, tokenizer)


def test_process_config_rejects_bad_values():
    with pytest.raises(ValueError, match="unknown modalities"):
        MultimodalProcessConfig.from_dict({"audio": {}})
    with pytest.raises(ValueError, match="unknown ImageProcessConfig keys"):
        MultimodalProcessConfig.from_dict({"image": {"max_pixel": 5}})
    with pytest.raises(ValueError, match="min_pixels <= max_pixels"):
        MultimodalProcessConfig.from_dict({"video": {"min_pixels": 10, "max_pixels": 5}})
    with pytest.raises(ValueError, match="fps > 0"):
        VideoProcessConfig(fps=0)
    video = MultimodalProcessConfig.from_dict({"video": {"fps": 1, "max_frames": 8}}).video
    assert (video.fps, video.max_frames, video.max_pixels) == (1, 8, 240000 * 1568)
    with pytest.raises(ValueError, match="too small"):
        process_images([random_image(0, 90, 90)], ImageProcessConfig(1, 1), VISION)


def test_a_media_marker_written_in_the_text_is_refused_before_the_engine(tiny):
    """`<|begin_of_video|>` typed into a message makes the image tokens after it video tokens:
    the prompt's preparation refuses it (a 400 for the request), not the engine's step."""
    from glmflash.multimodal import prepare_multimodal_prompt

    tokenizer, config = tiny
    text = f"[gMASK]<sop><|user|>see <|begin_of_video|> {IMAGE}<|assistant|>"
    with pytest.raises(ValueError, match="media marker"):
        prepare_multimodal_prompt(tokenizer.encode(text), config=config, tokenizer=tokenizer,
                                  images=[random_image(1, 60, 60)])
    fine = f"[gMASK]<sop><|user|>see {IMAGE}<|assistant|>"
    prepared = prepare_multimodal_prompt(tokenizer.encode(fine), config=config,
                                         tokenizer=tokenizer, images=[random_image(1, 60, 60)])
    assert prepared.token_ids.count(config.image_token_id) == prepared.image_inputs.num_tokens[0]
