"""The radix top-k of the indexer against a stable sort (ties to the lower index). Interpreter
on CPU with small blocks, so short rows cross blocks and segments; release widths on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from glmflash.kernels.indexer.topk_triton import TopkConfig, topk_indices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Eight keys a block, sixteen a segment: a 65-key row spans 5 segments of 2 blocks. The
# candidates listed after the first byte (every row) or after the second (every row).
SMALL = TopkConfig(block=8, min_segment=16, programs_per_sm=64, list_divisor=1)
SMALL_LISTED_LATE = dataclasses.replace(SMALL, list_divisor=1 << 20)


@pytest.fixture(params=[SMALL, SMALL_LISTED_LATE], ids=["listed_early", "listed_late"])
def small(request) -> TopkConfig:
    return request.param


def stable_topk(scores: torch.Tensor, lengths: list[int], k: int) -> list[list[int]]:
    """Per row: the indices of the k largest of scores[:length], ties to the lower index."""
    out = []
    for row, length in zip(scores.cpu(), lengths, strict=True):
        x = row[:length]
        x = torch.where(x == 0, torch.zeros_like(x), x)  # -0.0 ties with +0.0
        out.append(sorted(torch.sort(-x, stable=True).indices[:k].tolist()))
    return out


def check(scores: torch.Tensor, lengths: list[int], k: int, config: TopkConfig):
    """Run the kernel (scores past each length NaN, never read) and compare with the sort."""
    scores = scores.clone()
    for r, length in enumerate(lengths):
        scores[r, length:] = float("nan")
    got = topk_indices(scores.to(DEVICE), torch.tensor(lengths, dtype=torch.int32,
                                                       device=DEVICE), k, config=config).cpu()
    assert got.shape == (len(lengths), k) and got.dtype == torch.int32
    for r, (want, length) in enumerate(zip(stable_topk(scores, lengths, k), lengths,
                                           strict=True)):
        chosen = got[r, : min(length, k)]
        assert sorted(chosen.tolist()) == want, f"row {r}"
        assert (got[r, min(length, k):] == -1).all(), f"row {r} padding"


LENGTHS = [1, 15, 16, 17, 63, 64, 65]


@pytest.mark.parametrize("k", [1, 16], ids=lambda k: f"k{k}")
def test_random_rows_of_odd_lengths(k, small, poisoned_empty):
    gen = torch.Generator().manual_seed(42)
    check(torch.randn(len(LENGTHS), 65, generator=gen), LENGTHS, k, small)


def test_fewer_candidates_than_k_and_empty_rows(small, poisoned_empty):
    gen = torch.Generator().manual_seed(42)
    check(torch.randn(4, 40, generator=gen), [0, 3, 16, 40], 16, small)


def test_ties_go_to_the_lower_index(small, poisoned_empty):
    gen = torch.Generator().manual_seed(42)
    scores = torch.randint(0, 3, (len(LENGTHS), 65), generator=gen).float()
    scores[-1] = 0.5  # one value everywhere: the first k indices
    check(scores, LENGTHS, 9, small)


def test_infinite_and_signed_zero_scores(small, poisoned_empty):
    gen = torch.Generator().manual_seed(42)
    scores = torch.randn(4, 65, generator=gen)
    scores[0] = float("-inf")
    scores[1, ::3] = float("-inf")
    scores[2, ::2] = -0.0
    scores[2, 1::4] = 0.0
    scores[3, 5] = float("inf")
    check(scores, [65, 63, 64, 17], 16, small)


def test_keys_differing_only_in_low_bytes(small, poisoned_empty):
    """Scores a few thousand ulps apart share their top key byte: the later passes split them."""
    ulps = torch.randperm(65, generator=torch.Generator().manual_seed(42)).int() * 4099
    scores = (torch.full((1, 65), 1.0).view(torch.int32) + ulps).view(torch.float32)
    check(scores, [65], 16, small)
    check(-scores, [65], 16, small)


def test_threshold_with_last_byte_ff(small, poisoned_empty):
    """The k-th largest key ends in 0xFF, with ties to it in every segment and keys just
    below and above it: no key can sit above it in its last byte (nothing past bin 255 is
    read)."""
    gen = torch.Generator().manual_seed(42)
    offsets = torch.tensor([0, 0, -1, 256, 0, -255, 512, 0])  # from 1.0's bits + 0xFF
    picks = offsets[torch.randint(0, len(offsets), (2, 65), generator=gen)]
    bits = torch.full((2, 65), 0x3F8000FF, dtype=torch.int32) + picks.int()
    scores = bits.view(torch.float32)
    scores[:, 3::7] = float("-inf")  # first key byte 0: a misread bin 0 would count them
    above = int((picks > 0).sum(1).min())
    check(scores, [65, 64], above + 3, small)
    check(scores, [65, 64], above + 15, small)


def test_default_config_on_wider_rows(poisoned_empty):
    gen = torch.Generator().manual_seed(42)
    # Normal scores list their candidates after the first byte, scores in [1, 2) after the
    # second (every key shares the first).
    check(torch.randn(3, 3000, generator=gen), [3000, 1025, 1023], 64, TopkConfig())
    check(torch.rand(3, 3000, generator=gen) + 1.0, [3000, 1025, 1023], 64, TopkConfig())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [TopkConfig(), TopkConfig(block=4096, min_segment=4096)],
                         ids=["default", "blocks_of_4096"])
@pytest.mark.parametrize("one_binade", [False, True], ids=["normal", "one_binade"])
@pytest.mark.parametrize("rows,width", [(1, 32768), (32, 262144), (8, 4096)])
def test_release_widths_match_torch_topk_gpu(rows, width, one_binade, config):
    """k = 512 pools (top-2048 tokens, kpool 4); values equal torch.topk's (robust to ties).
    Scores in [1, 2) share their first key byte: every key is a candidate."""
    gen = torch.Generator(device="cuda").manual_seed(42)
    if one_binade:
        scores = torch.rand(rows, width, generator=gen, device="cuda") + 1.0
    else:
        scores = torch.randn(rows, width, generator=gen, device="cuda")
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=gen, device="cuda",
                            dtype=torch.int32)
    lengths[0] = width
    got = topk_indices(scores, lengths, 512, config=config)
    for r in range(rows):
        length = int(lengths[r])
        want = scores[r, :length].topk(512).values.sort().values
        assert torch.equal(scores[r, got[r].long()].sort().values, want)
        assert len(set(got[r].tolist())) == 512


@pytest.mark.gpu
def test_graph_replay_reads_lengths_from_the_device():
    scores = torch.randn(4, 8192, device="cuda")
    lengths = torch.tensor([8192, 100, 0, 3000], dtype=torch.int32, device="cuda")
    topk_indices(scores, lengths, 512)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = topk_indices(scores, lengths, 512)
    lengths.copy_(torch.tensor([5000, 8192, 600, 1], dtype=torch.int32))
    graph.replay()
    want = stable_topk(scores, lengths.tolist(), 512)
    for r, length in enumerate(lengths.tolist()):
        assert sorted(got[r, : min(length, 512)].tolist()) == want[r]
        assert (got[r, min(length, 512):] == -1).all()
