"""The transformers glm5_next processors as references, usable without torchvision.

The image reference is the PIL back-end class (no torchvision needed). The video processor exists
only in a torchvision flavour: with torchvision importable it is used as is (after registering
the two ops a CUDA wheel needs on a CPU torch, spec/model.md §9.1); otherwise a stand-in for the
four `torchvision.transforms.v2.functional` calls it makes is installed. The stand-in's resize is
the uint8 antialiased bicubic kernel that torchvision dispatches to on the CPU; it was checked
bit-exact against torchvision 0.28.0 on the videos of these tests.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _resize(image, size, interpolation=InterpolationMode.BILINEAR, antialias=True):
    assert interpolation == InterpolationMode.BICUBIC and image.dtype == torch.uint8
    shape = image.shape
    if tuple(size) == tuple(shape[-2:]):
        return image
    flat = image.reshape(-1, *shape[-3:])
    out = torch.nn.functional.interpolate(flat, size=list(size), mode="bicubic",
                                          align_corners=False, antialias=antialias)
    return out.reshape(*shape[:-2], *out.shape[-2:])


def _pad(image, padding, fill=0):
    left, top, right, bottom = padding
    return torch.nn.functional.pad(image, (left, right, top, bottom), value=fill)


def _normalize(image, mean, std, inplace=False):
    mean = torch.as_tensor(mean, dtype=image.dtype).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=image.dtype).view(-1, 1, 1)
    return image.sub_(mean).div_(std) if inplace else (image - mean) / std


def _grayscale_to_rgb(image):
    return image if image.shape[-3] == 3 else image.expand(*image.shape[:-3], 3, *image.shape[-2:])


def _functional_stub() -> types.ModuleType:
    module = types.ModuleType("torchvision.transforms.v2.functional")
    module.InterpolationMode = InterpolationMode
    module.resize, module.pad = _resize, _pad
    module.normalize, module.grayscale_to_rgb = _normalize, _grayscale_to_rgb
    return module


def _has_real_torchvision() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
        return True
    except Exception:
        pass
    # A CUDA wheel on a CPU torch: pre-define the two ops its import registers fake kernels for.
    for name in [n for n in sys.modules if n.split(".")[0] == "torchvision"]:
        del sys.modules[name]
    try:
        lib = torch.library.Library("torchvision", "DEF")
        lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _KEEP.append(lib)
        import torchvision.transforms.v2.functional  # noqa: F401, F811
        return True
    except Exception:
        return False


_KEEP: list = []
# At import, before a test module imports transformers' video utilities (which import torchvision).
HAS_TORCHVISION = _has_real_torchvision()


@pytest.fixture(scope="session")
def has_torchvision() -> bool:
    return HAS_TORCHVISION


@pytest.fixture(scope="session")
def ref_video(has_torchvision):
    """(Glm5NextVideoProcessor instance, extra kwargs for its __call__)."""
    name = "transformers.models.glm5_next.video_processing_glm5_next"
    if has_torchvision:
        return importlib.import_module(name).Glm5NextVideoProcessor(), {}
    import transformers.image_processing_backends as backends
    import transformers.video_processing_utils as video_utils

    functional = _functional_stub()
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
    stubs = {n: types.ModuleType(n) for n in names}
    stubs["torchvision.transforms.v2"].functional = functional
    stubs["torchvision.transforms.v2.functional"] = functional
    with pytest.MonkeyPatch.context() as patch:
        for n, module in stubs.items():
            patch.setitem(sys.modules, n, module)
        module = importlib.import_module(name)
    # The two transformers modules skipped their torchvision import; they only call `tvF.*`.
    backends.tvF = video_utils.tvF = functional
    return module.Glm5NextVideoProcessor(), {"resample": InterpolationMode.BICUBIC}


@pytest.fixture(scope="session")
def ref_image(has_torchvision):
    from transformers.models.glm5_next.image_processing_pil_glm5_next import (
        Glm5NextImageProcessorPil,
    )

    return Glm5NextImageProcessorPil()


@pytest.fixture(scope="session")
def reference_processor(tiny_dirs, has_torchvision, ref_image, ref_video):
    """Glm5NextProcessor with the tiny tokenizer and the two reference processors above."""
    from transformers import AutoTokenizer
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dirs["embedded"]))
    with pytest.MonkeyPatch.context() as patch:
        if not has_torchvision:
            # Its class check looks the video processor up in a mapping that needs torchvision.
            patch.setattr(Glm5NextProcessor, "check_argument_for_proper_class",
                          lambda self, name, arg: type(arg))
        return Glm5NextProcessor(image_processor=ref_image, tokenizer=tokenizer,
                                 video_processor=ref_video[0])


def make_video(path: Path, *, num_frames: int, fps: int, height: int, width: int) -> Path:
    """Encode a moving colour pattern with mpeg4 (in every PyAV wheel) into an .mp4."""
    # Lazy, so these tests collect without PyAV (the GPU machine's wheel bundle leaves it out).
    av = pytest.importorskip("av")
    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        rows, cols = np.mgrid[0:height, 0:width]
        for i in range(num_frames):
            rgb = np.stack([(cols * 2 + i * 9) % 256, (rows * 3 + i * 5) % 256,
                            (rows + cols + i * 20) % 256], axis=-1).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        container.mux(stream.encode())
    return path


def random_image(seed: int, height: int, width: int, mode: str = "RGB"):
    """Smooth gradients plus noise, so resizing really interpolates."""
    rng = np.random.default_rng(seed)
    rows = np.arange(height, dtype=np.int32)[:, None, None]
    cols = np.arange(width, dtype=np.int32)[None, :, None]
    gains = np.array([3, 5, 7, 11], dtype=np.int32)
    base = (rows * gains + cols * gains[::-1]) % 256
    noise = rng.integers(-40, 40, (height, width, 4), dtype=np.int16)
    noisy = np.clip(base + noise, 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGBA")
    return image if mode == "RGBA" else image.convert(mode)


def oracle_media_kwargs(prompt) -> dict:
    """The reference model's pixel arguments for a MultimodalPrompt."""
    kwargs = {}
    if prompt.image_inputs is not None:
        kwargs.update(pixel_values=prompt.image_inputs.pixel_values,
                      image_grid_thw=prompt.image_inputs.grid_thw)
    if prompt.video_inputs is not None:
        kwargs.update(pixel_values_videos=prompt.video_inputs.pixel_values,
                      video_grid_thw=prompt.video_inputs.grid_thw)
    return kwargs
