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


@pytest.mark.parametrize(("queries", "splits"), [(1, 32), (8, 16), (32, 4), (64, 2), (66, 2),
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
    # Two whole steps per split at least: one query gets half the splits.
    (1, SparseMlaConfig(min_split_steps=2), 16),
    (8, SparseMlaConfig(min_split_steps=2), 16),
    # Half a wave.
    (8, SparseMlaConfig(waves=0.5), 8),
])
def test_split_programs_fill_one_wave(queries, config, splits):
    plan = split_plan(queries, HEADS, WIDTH, STEP, SMS, config)
    assert plan.num_splits == splits
    assert queries * splits <= SMS * config.waves


def test_workspace_follows_the_config():
    cpu = torch.device("cpu")
    bf16 = SparseMlaWorkspace.create(2, HEADS, RANK, WIDTH, cpu, SMS)
    assert bf16.partial_out.dtype == torch.bfloat16 and bf16.partial_lse.dtype == torch.float32
    fp32 = SparseMlaWorkspace.create(2, HEADS, RANK, WIDTH, cpu, SMS, out_dtype=torch.float32)
    assert fp32.partial_out.dtype == torch.float32
    kept = SparseMlaWorkspace.create(2, HEADS, RANK, WIDTH, cpu, SMS,
                                     SparseMlaConfig(partial_dtype=torch.float32))
    assert kept.partial_out.dtype == torch.float32
