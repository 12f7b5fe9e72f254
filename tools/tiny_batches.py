"""Training batches of the tiny model: batch k of a run is made from its own random stream
(seed, k), so batches can be made in any order, by worker processes, and a run replays from its
seed whatever the number of workers.

A batch is host data only (numpy): the packed token ids of whole samples (at most a number of
tokens, or in a fixed shape: one sample per sequence of set lengths, padded), their loss weights,
sequence offsets, and the pictures' pixels.
"""

from __future__ import annotations

import logging
import multiprocessing
import random
import tempfile
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from glmflash.config import ModelConfig
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer
from tools.tiny_data import MIXTURE, RECIPE_VERSION, Sample, SampleMaker, make_sample

logger = logging.getLogger(__name__)
# Loss weight of the tokens outside the assistant turns (prompts, tool schemas, tool results).
PROMPT_WEIGHT = 0.25


@dataclass
class HostBatch:
    ids: np.ndarray
    """`[T]` int64 token ids, samples back to back."""
    is_trained: np.ndarray
    """`[T]` bool: the token is part of an assistant turn (plain text: all of it)."""
    cu_seqlens: list[int]
    pixel_values: np.ndarray | None
    """`[N, C*T*P*P]` float32 pixels of the batch's pictures (processor order), or None."""
    grid_thw: np.ndarray | None
    is_padding: np.ndarray | None = None
    """`[T]` bool: filler after a sample (fixed-shape batches), weighing nothing."""

    @property
    def weights(self) -> np.ndarray:
        weights = np.where(self.is_trained, 1.0, PROMPT_WEIGHT).astype(np.float32)
        return weights if self.is_padding is None else np.where(self.is_padding, 0.0, weights)

    @property
    def num_samples(self) -> int:
        return len(self.cu_seqlens) - 1


def pack_samples(samples: list[Sample]) -> HostBatch:
    lens = [len(s.ids) for s in samples]
    images = [s.image_inputs for s in samples if s.image_inputs is not None]
    return HostBatch(
        ids=np.concatenate([s.ids for s in samples]).astype(np.int64),
        is_trained=np.concatenate([s.mask for s in samples]).astype(bool),
        cu_seqlens=np.cumsum([0, *lens]).tolist(),
        pixel_values=torch.cat([i.pixel_values for i in images]).float().numpy()
        if images else None,
        grid_thw=torch.cat([i.grid_thw for i in images]).numpy() if images else None)


def make_batch(maker: SampleMaker, seed: int, step: int, max_tokens: int) -> HostBatch:
    """Batch `step` of the run `seed`: samples drawn until the next one would pass
    `max_tokens` (a first sample always fits)."""
    rng = random.Random(f"{seed}:{step}")
    samples, size = [], 0
    while True:
        sample = make_sample(maker, rng)
        if samples and size + len(sample.ids) > max_tokens:
            return pack_samples(samples)
        samples.append(sample)
        size += len(sample.ids)


@dataclass(frozen=True)
class FixedShape:
    """The one batch shape of a run whose steps replay a CUDA graph: a sequence of each of
    `lengths` tokens (a sample padded to it) and room for `pictures` pictures (blank ones fill
    it; their features land on no token)."""

    lengths: tuple[int, ...]
    pictures: int

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


# The grid of every generated picture (tiny_vision_tasks), also the blank pictures' grid.
PICTURE_GRID = (1, 8, 8)
# The last sequence's length: the generated samples stay under it.
LONGEST_SAMPLE = 640
# Samples drawn to plan the lengths.
PLAN_DRAWS = 2048
# Room for pictures: this many times the mixture's expected count, plus 2.
PICTURE_ROOM = 2.0


def plan_shape(maker: SampleMaker, seed: int, tokens: int) -> FixedShape:
    """About `tokens` tokens in sequences of the lengths at the quantiles of the samples'
    lengths (drawn from their own stream of `seed`), so that samples fill them with little
    padding."""
    rng = random.Random(f"{seed}:shape")
    lens = np.array([len(make_sample(maker, rng).ids) for _ in range(PLAN_DRAWS)])
    rows = max(2, round(tokens / lens.mean()))
    quantiles = np.quantile(lens, (np.arange(rows) + 0.5) / rows)
    lengths = np.maximum(8, np.ceil(quantiles / 8) * 8).astype(int)
    lengths[-1] = max(lengths[-1], LONGEST_SAMPLE)
    pictures = int(np.ceil(PICTURE_ROOM * MIXTURE["image"] * rows)) + 2
    return FixedShape(tuple(int(n) for n in lengths), pictures)


def make_fixed_batch(maker: SampleMaker, seed: int, step: int, shape: FixedShape) -> HostBatch:
    """Batch `step` of the run `seed` in `shape`: samples drawn in order, each into the
    shortest free sequence that holds it, skipping those that fit no free sequence (or whose
    pictures pass the room left)."""
    rng = random.Random(f"{seed}:{step}")
    free = sorted(range(len(shape.lengths)), key=lambda i: shape.lengths[i])
    placed: dict[int, Sample] = {}
    pictures = 0
    while free:
        sample = make_sample(maker, rng)
        count = 0 if sample.image_inputs is None else len(sample.image_inputs.grid_thw)
        slot = next((i for i in free if shape.lengths[i] >= len(sample.ids)), None)
        if slot is None or pictures + count > shape.pictures:
            continue
        free.remove(slot)
        placed[slot] = sample
        pictures += count
    samples = [placed[i] for i in range(len(shape.lengths))]
    padding = [n - len(s.ids) for s, n in zip(samples, shape.lengths, strict=True)]
    batch = pack_samples([Sample(s.ids + [0] * pad, s.mask + [0] * pad, s.image_inputs)
                          for s, pad in zip(samples, padding, strict=True)])
    batch.is_padding = np.concatenate([np.arange(n) >= n - pad
                                       for n, pad in zip(shape.lengths, padding, strict=True)])
    vision = maker.config.vision
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    return _with_blank_pictures(batch, shape.pictures, width)


def _with_blank_pictures(batch: HostBatch, room: int, width: int) -> HostBatch:
    """`batch` with zero pictures (pixel rows of `width`) appended up to `room`, all pictures
    of `PICTURE_GRID`."""
    grids = batch.grid_thw if batch.grid_thw is not None else np.zeros((0, 3), np.int64)
    if not (grids == PICTURE_GRID).all():
        raise ValueError(f"fixed-shape batches need pictures of grid {PICTURE_GRID}, got {grids}")
    pixels = batch.pixel_values if batch.pixel_values is not None else \
        np.zeros((0, width), np.float32)
    blank = room - len(grids)
    patches = blank * int(np.prod(PICTURE_GRID))
    batch.pixel_values = np.concatenate([pixels, np.zeros((patches, width), np.float32)])
    batch.grid_thw = np.concatenate([grids, np.tile(PICTURE_GRID, (blank, 1))]).astype(
        grids.dtype)
    return batch


_WORKER_MAKER: SampleMaker | None = None


def _init_worker(config_dict: dict, recipe: int) -> None:
    global _WORKER_MAKER
    torch.set_num_threads(1)
    _WORKER_MAKER = sample_maker(config_dict, recipe)


def batch_of(maker: SampleMaker, seed: int, step: int, size: int | FixedShape) -> HostBatch:
    """Batch `step` of the run `seed`: of at most `size` tokens, or of a fixed shape."""
    if isinstance(size, FixedShape):
        return make_fixed_batch(maker, seed, step, size)
    return make_batch(maker, seed, step, size)


def _worker_batch(seed: int, step: int, size: int | FixedShape) -> HostBatch:
    return batch_of(_WORKER_MAKER, seed, step, size)


def sample_maker(config_dict: dict, recipe: int = RECIPE_VERSION) -> SampleMaker:
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-"))
    write_tiny_tokenizer(tokenizer_dir)
    return SampleMaker(tokenizer_dir, ModelConfig.from_dict(config_dict), recipe)


class BatchStream:
    """Batches `first`, `first + 1`, ... of a run, in order; made ahead by `num_workers`
    processes (none: made on demand in this process)."""

    def __init__(self, config_dict: dict, seed: int, size: int | FixedShape, *,
                 num_workers: int = 0, first: int = 0, recipe: int = RECIPE_VERSION) -> None:
        self.seed, self.size, self.next_step = seed, size, first
        self.pool, self.pending = None, deque()
        if num_workers > 0:
            # spawn: the workers never inherit a CUDA context or torch's thread pools.
            context = multiprocessing.get_context("spawn")
            self.pool = context.Pool(num_workers, _init_worker, (config_dict, recipe))
            self.ahead = 4 * num_workers
        else:
            self.maker = sample_maker(config_dict, recipe)

    def __iter__(self) -> Iterator[HostBatch]:
        return self

    def __next__(self) -> HostBatch:
        step, self.next_step = self.next_step, self.next_step + 1
        if self.pool is None:
            return batch_of(self.maker, self.seed, step, self.size)
        while len(self.pending) < self.ahead:
            queued = step + len(self.pending)
            self.pending.append(self.pool.apply_async(_worker_batch,
                                                      (self.seed, queued, self.size)))
        return self.pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
