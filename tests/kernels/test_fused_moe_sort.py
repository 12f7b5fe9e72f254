"""The two-launch sort (fused_moe/triton_sort.py) against the one-launch form: the same layout
bit for bit, on odd sizes (interpreter on CPU; with CUDA also a release-size check)."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.fused_moe import triton_impl
from glmflash.kernels.fused_moe.triton_sort import SortConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE_LAUNCH = SortConfig(scan_min_pairs=1 << 62)


def both(ids: torch.Tensor, num_experts: int, block_m: int, config: SortConfig):
    want = triton_impl.sort_pairs(ids, num_experts, block_m, ONE_LAUNCH)
    got = triton_impl.sort_pairs(ids, num_experts, block_m, config)
    return got, want


def check(ids, num_experts, block_m, config):
    (rows, blocks), (want_rows, want_blocks) = both(ids, num_experts, block_m, config)
    assert torch.equal(blocks, want_blocks)
    used = int((want_blocks >= 0).sum()) * block_m  # rows of unused blocks are never read
    assert torch.equal(rows[:used], want_rows[:used])
    return blocks


SMALL = SortConfig(scan_min_pairs=0, chunk=64, sub=16, block_rows=4)
CASES = {
    # pairs, experts, block rows, share of -1 ids
    "one-pair": (1, 5, 16, 0.0),
    "chunk-edge+1": (65, 7, 16, 0.2),
    "many-chunks": (300, 6, 16, 0.1),
    "bm64-partial": (203, 9, 64, 0.0),
    "all-skipped": (40, 4, 16, 1.0),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_same_layout_as_one_launch(case, seeded):
    num_pairs, num_experts, block_m, skipped = case
    ids = torch.randint(0, num_experts, (num_pairs,), generator=seeded)
    ids[torch.rand(num_pairs, generator=seeded) < skipped] = -1
    blocks = check(ids.to(DEVICE).view(-1, 1), num_experts, block_m, SMALL)
    if skipped == 1.0:
        assert (blocks == -1).all()


def test_skewed_and_expert_out_of_subset(seeded):
    # most pairs on expert 0 (several blocks), ids >= E (another rank's experts) skipped
    ids = torch.where(torch.rand(257, generator=seeded) < 0.7, 0,
                      torch.randint(0, 12, (257,), generator=seeded))
    check(ids.to(DEVICE).view(-1, 1), 9, 16, SMALL)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [2048, 8192])
def test_release_size_gpu(num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(42)
    scores = torch.rand(num_tokens, 288, device="cuda", generator=gen)
    ids = scores.topk(8, dim=1).indices
    for block_m in (64, 128):
        check(ids, 288, block_m, SortConfig(scan_min_pairs=0))
