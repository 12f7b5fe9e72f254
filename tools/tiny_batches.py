"""Training batches of the tiny model: batch k of a run is made from its own random stream
(seed, k), so batches can be made in any order, by worker processes, and a run replays from its
seed whatever the number of workers.

A batch is host data only (numpy): the packed token ids of whole samples (at most `max_tokens`
tokens), their loss weights, sequence offsets, and the pictures' pixels.
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
from tools.tiny_data import Sample, SampleMaker, make_sample

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

    @property
    def weights(self) -> np.ndarray:
        return np.where(self.is_trained, 1.0, PROMPT_WEIGHT).astype(np.float32)

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


_WORKER_MAKER: SampleMaker | None = None


def _init_worker(config_dict: dict) -> None:
    global _WORKER_MAKER
    torch.set_num_threads(1)
    _WORKER_MAKER = sample_maker(config_dict)


def _worker_batch(seed: int, step: int, max_tokens: int) -> HostBatch:
    return make_batch(_WORKER_MAKER, seed, step, max_tokens)


def sample_maker(config_dict: dict) -> SampleMaker:
    tokenizer_dir = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-"))
    write_tiny_tokenizer(tokenizer_dir)
    return SampleMaker(tokenizer_dir, ModelConfig.from_dict(config_dict))


class BatchStream:
    """Batches `first`, `first + 1`, ... of a run, in order; made ahead by `num_workers`
    processes (none: made on demand in this process)."""

    def __init__(self, config_dict: dict, seed: int, max_tokens: int, *, num_workers: int = 0,
                 first: int = 0) -> None:
        self.seed, self.max_tokens, self.next_step = seed, max_tokens, first
        self.pool, self.pending = None, deque()
        if num_workers > 0:
            # spawn: the workers never inherit a CUDA context or torch's thread pools.
            context = multiprocessing.get_context("spawn")
            self.pool = context.Pool(num_workers, _init_worker, (config_dict,))
            self.ahead = 4 * num_workers
        else:
            self.maker = sample_maker(config_dict)

    def __iter__(self) -> Iterator[HostBatch]:
        return self

    def __next__(self) -> HostBatch:
        step, self.next_step = self.next_step, self.next_step + 1
        if self.pool is None:
            return make_batch(self.maker, self.seed, step, self.max_tokens)
        while len(self.pending) < self.ahead:
            queued = step + len(self.pending)
            self.pending.append(self.pool.apply_async(_worker_batch,
                                                      (self.seed, queued, self.max_tokens)))
        return self.pending.popleft().get()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None
