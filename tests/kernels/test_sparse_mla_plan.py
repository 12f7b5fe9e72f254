"""How the sparse MLA launcher splits a selection at the release shapes (64 heads x 512, 2051
slots, 64-slot steps, the H200's 132 SMs): pure arithmetic, no kernel."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.sparse_mla.plan import (
    DEFAULT_CONFIG,
    SparseMlaConfig,
    SparseMlaLaunch,
    SparseMlaWorkspace,
    split_plan,
)

HEADS, RANK, WIDTH, STEP, SMS = 64, 512, 2051, 64, 132


@pytest.mark.parametrize(("queries", "splits"), [(1, 16), (8, 16), (32, 4), (64, 2), (66, 2),
                                                 (67, 1), (4096, 1)])
def test_splits_fill_one_wave(queries, splits):
    plan = split_plan(queries, HEADS, WIDTH, STEP, SMS, DEFAULT_CONFIG)
    assert plan.num_splits == splits
    assert splits == 1 or queries * splits <= SMS
    # Every whole step goes to exactly one split, at most one step apart.
    assert plan.steps_per_split * splits + plan.extra_steps == plan.full_steps == WIDTH // STEP
    assert plan.extra_steps < splits
    assert plan.steps_per_split >= DEFAULT_CONFIG.min_split_steps or splits == 1


def test_splits_bounded_by_width_and_workspace():
    config = SparseMlaConfig(min_split_steps=1)
    assert split_plan(1, HEADS, 200, STEP, SMS, config).num_splits == 3
    assert split_plan(1, HEADS, 40, STEP, SMS, config).num_splits == 1
    assert split_plan(8, HEADS, WIDTH, STEP, SMS, config, max_splits=5).num_splits == 5


@pytest.mark.parametrize("queries", [1, 2, 8, 16, 32, 64, 128, 4096])
def test_workspace_is_bounded_by_one_wave(queries):
    workspace = SparseMlaWorkspace.create(queries, HEADS, RANK, WIDTH, torch.device("cpu"), SMS)
    rows = workspace.partial_out.shape[0]
    assert rows <= max(queries, SMS)
    assert workspace.max_splits(queries, HEADS, RANK) * queries <= rows


def test_launch_shapes_are_checked():
    with pytest.raises(ValueError):
        SparseMlaLaunch(48, 2)
    with pytest.raises(ValueError):
        SparseMlaLaunch(32, 2, tail_slots=64)


@pytest.mark.parametrize(("queries", "config", "splits"), [
    # Two value halves: half the splits for the same wave.
    (8, SparseMlaConfig(value_halves=True), 8),
    # 32-head blocks: twice the programs per query.
    (1, SparseMlaConfig(split_heads=32, min_split_steps=1), 32),
    (8, SparseMlaConfig(split_heads=32), 8),
    # Capped splits, and one step per split.
    (1, SparseMlaConfig(max_splits=8), 8),
    (1, SparseMlaConfig(min_split_steps=1), 32),
])
def test_split_programs_fill_one_wave(queries, config, splits):
    plan = split_plan(queries, HEADS, WIDTH, STEP, SMS, config)
    assert plan.num_splits == splits
    blocks = HEADS // config.split_heads * config.value_blocks
    assert queries * blocks * splits <= SMS


def test_workspace_follows_the_config():
    config = SparseMlaConfig(split_heads=16, value_halves=True, bf16_partials=True)
    workspace = SparseMlaWorkspace.create(2, HEADS, RANK, WIDTH, torch.device("cpu"), SMS, config)
    assert workspace.partial_out.dtype == torch.bfloat16
    assert workspace.arrivals.numel() == 2 * 4 * 2
    # A workspace made for 64-head blocks has too few counters for this config: no split.
    assert SparseMlaWorkspace.create(2, HEADS, RANK, WIDTH, torch.device("cpu"), SMS
                                     ).max_splits(2, HEADS, RANK, config) == 1
