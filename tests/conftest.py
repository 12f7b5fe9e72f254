"""Shared fixtures: tiny checkpoints per variant, their oracle, seeded tensors, tolerances."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

# Without CUDA, Triton kernels run in its interpreter. Triton picks that mode when a kernel is
# decorated, so it is set before any glmflash module is imported: a test module that imports
# kernels (tests/model/test_gpu.py) can otherwise compile them for a GPU that is not there,
# ahead of a kernel test module that would set it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glmflash.config import ModelConfig  # noqa: E402
from glmflash.model.forward_batch import (  # noqa: E402
    build_forward_batch,
    decode_batch,
    pack_decode,
    token_slots_of,
)
from glmflash.model.glm import GlmForCausalLM  # noqa: E402
from glmflash.model.state import ModelState  # noqa: E402
from glmflash.model.weights import load_checkpoint  # noqa: E402
from glmflash.tiny.checkpoint import make_tiny_checkpoint  # noqa: E402
from tests.multimodal.fake_net import fake_net  # noqa: E402, F401 - a fixture for media-fetch tests

# Measured on the tiny models in fp32 (spec/model.md §9.3: 1e-5...1e-3 is the reference's own
# cached-vs-uncached spread); see tests/model/README.md for the figures.
LOGIT_ATOL = 1e-4


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep the embedded checkpoint of the tests out of the user's cache."""
    os.environ.setdefault("GLMFLASH_CACHE_DIR", str(tmp_path_factory.mktemp("glmflash-cache")))


@pytest.fixture(autouse=True)
def _torch_threads():
    """A test that starts CPU ranks in-process (rank 0 takes its share of the cores) must not
    change the thread count, hence the float summation order, of the tests after it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """variant -> checkpoint folder (FP8 release layout), made once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {v: make_tiny_checkpoint(root / v, seed=0, variant=v, progress=False)
            for v in ("embedded", "kpool16", "recipe")}


@pytest.fixture(scope="session")
def oracles(tiny_dirs, tmp_path_factory):
    """variant -> transformers Glm5NextForConditionalGeneration on the dequantised weights."""
    from tests.oracle import load_oracle, write_dequantized_copy

    root = tmp_path_factory.mktemp("oracle")
    return {v: load_oracle(write_dequantized_copy(d, root / v)) for v, d in tiny_dirs.items()}


def load_tiny(path: Path, dtype: torch.dtype = torch.float32) -> GlmForCausalLM:
    config = ModelConfig.from_hf(path)
    model = GlmForCausalLM(config, dtype)
    load_checkpoint(model, path, num_layers=config.num_hidden_layers, progress=False)
    return model.eval()


class PackedRunner:
    """Drives a model with explicit state: each sequence owns a state slot and `max_len` token
    slots in pages of PAGE_SIZE, handed out in a scrambled order so that no sequence's pages
    are contiguous (the page table must be followed)."""

    PAGE_SIZE = 16

    def __init__(self, model: GlmForCausalLM, num_seqs: int, max_len: int = 512,
                 device: str = "cpu", scramble: bool = True, **state_options: bool) -> None:
        """`state_options`: ModelState's flags (`fp8_index_keys`, `fp8_index_queries`)."""
        if next(model.parameters()).device.type != device:
            model = model.to(device)
        self.model, self.max_len, self.device = model, max_len, device
        pages_per_seq = -(-max_len // self.PAGE_SIZE)
        count = num_seqs * pages_per_seq
        order = torch.randperm(count, generator=torch.Generator().manual_seed(0)) if scramble \
            else torch.arange(count)
        self.pages = order.view(num_seqs, pages_per_seq)
        self.page_table = self.pages.to(torch.int32).to(device)
        self.state = ModelState(model.config,
                                num_token_slots=num_seqs * pages_per_seq * self.PAGE_SIZE,
                                num_state_slots=num_seqs, dtype=model.dtype, device=device,
                                **state_options)
        self.done = [0] * num_seqs

    def forward(self, chunks: dict[int, list[int]], all_logits: bool = True,
                layer_outputs: list | None = None) -> torch.Tensor:
        """Feed `chunks[s]` (new tokens of sequence s) for all s in one packed batch."""
        ids, token_slots, cu, prefix, slots = [], [], [0], [], []
        for s, toks in chunks.items():
            start = self.done[s]
            ids += toks
            token_slots.append(token_slots_of(self.pages[s].tolist(), start, len(toks),
                                              self.PAGE_SIZE))
            cu.append(len(ids))
            prefix.append(start)
            slots.append(s)
            self.done[s] += len(toks)
        batch = build_forward_batch(ids, np.concatenate(token_slots), cu, prefix, slots,
                                    self.page_table, self.PAGE_SIZE)
        return self.model(batch, self.state, all_logits=all_logits, layer_outputs=layer_outputs)

    def decode(self, tokens: dict[int, int], max_pools: int) -> torch.Tensor:
        """One new token per sequence through the device-resident decode form."""
        seqs = list(tokens)
        positions = [self.done[s] for s in seqs]
        token_slots = [int(token_slots_of(self.pages[s].tolist(), p, 1, self.PAGE_SIZE)[0])
                       for s, p in zip(seqs, positions, strict=True)]
        packed = pack_decode(list(tokens.values()), token_slots, positions, seqs)
        for s in seqs:
            self.done[s] += 1
        batch = decode_batch(torch.from_numpy(packed).to(self.device), self.page_table,
                             self.PAGE_SIZE, max_pools)
        return self.model(batch, self.state)


@pytest.fixture
def nan_empty(monkeypatch):
    """torch.empty / empty_like return NaN-filled floats, so unwritten outputs show up."""
    empty, empty_like = torch.empty, torch.empty_like

    def fill(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: fill(empty_like(*a, **k)))


POISON = -7


@pytest.fixture
def poisoned_empty(monkeypatch):
    """Integer torch.empty filled with POISON, floats with NaN: unwritten entries show up."""
    empty = torch.empty

    def fill(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else POISON)

    monkeypatch.setattr(torch, "empty", fill)


@pytest.fixture
def seeded():
    return torch.Generator().manual_seed(42)
