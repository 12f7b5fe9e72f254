"""The warp-specialised Gluon sparse MLA (sparse_mla/gluon_sm90.py): compiled for sm_90 on any
machine with Gluon (no spills, asynchronous wgmma), and on an SM90 GPU against ref.py at the
release shapes, split and unsplit, with the selections of test_sparse_mla_triton.py (-1
padding, empty and one-slot selections, splits that see no slot)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmflash.kernels.sparse_mla import gluon_sm90, sparse_mla_ref
from glmflash.kernels.sparse_mla.plan import SparseMlaWorkspace
from glmflash.kernels.triton_utils import num_sms
from tests.kernels.test_sparse_mla_triton import BF16_ATOL, _case

GLUON = gluon_sm90.GLUON_SPARSE_MLA_CONFIG


def _sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    probe = torch.zeros(1, 64, 512, dtype=torch.bfloat16, device="cuda")
    return gluon_sm90.available(probe, probe[0])


needs_sm90 = pytest.mark.skipif(not _sm90(), reason="the Gluon kernel needs an SM90 GPU")


@pytest.mark.skipif(gluon_sm90.gluon is None, reason="this Triton has no Gluon")
def test_compiles_for_sm90_without_spills_or_serialised_wgmma():
    """tools/gluon_check.py (its own process: it installs a stand-in driver) compiles the
    split and unsplit forms for sm_90; ptxas spills nothing and keeps the wgmma async."""
    tool = Path(__file__).resolve().parents[2] / "tools" / "gluon_check.py"
    done = subprocess.run([sys.executable, str(tool), "--only", "sparse_mla"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_serves_only_sm90_bf16_release_widths():
    q = torch.zeros(1, 64, 512, dtype=torch.bfloat16)
    assert not gluon_sm90.available(q, q[0])  # the CPU
    if _sm90():
        q = q.cuda()
        assert gluon_sm90.available(q, q[0])
        assert not gluon_sm90.available(q.float(), q[0].float())
        assert not gluon_sm90.available(q[:, :32], q[0])
        assert not gluon_sm90.available(q[..., :256], q[0, :, :256])


def test_never_served_on_the_cpu():
    q, latent, slots = _case(32, 64, 512, 2051, dtype=torch.bfloat16, cache=3000)
    assert not gluon_sm90.serves(q.cpu(), latent.cpu(), slots.cpu())


@pytest.mark.gpu
@needs_sm90
def test_dispatch_takes_it_where_programs_run_four_steps_or_more_gpu():
    """kernels/sparse_mla: a decode of 1 or 8 queries (programs of 1-2 steps) keeps the Triton
    kernel; 32 queries (8 steps a split) and prefill take this one, with its bits."""
    from glmflash.kernels.sparse_mla import sparse_mla, sparse_mla_workspace

    for tokens, gluon in ((1, False), (8, False), (32, True), (300, True)):
        q, latent, slots = _case(tokens, 64, 512, 2051, dtype=torch.bfloat16, cache=20000)
        workspace = sparse_mla_workspace(q, slots)
        assert gluon_sm90.serves(q, latent, slots, workspace) == gluon, tokens
        got = sparse_mla(q, latent, slots, scale=1 / 16, workspace=workspace)
        if gluon:
            want = gluon_sm90.sparse_mla(q, latent, slots, scale=1 / 16, workspace=workspace)
            assert torch.equal(got, want)


CONFIGS = {
    "default": GLUON,
    "half_wave": dataclasses.replace(GLUON, waves=0.5),
    "steps32_stages4": dataclasses.replace(GLUON, block_slots=32, stages=4),
    "program_per_item": dataclasses.replace(GLUON, persistent=False),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("tokens", [1, 8, 32, 300, 4096], ids=lambda t: f"T{t}")
def test_release_shape_gpu(tokens, config, nan_empty):
    """64 heads x 512, 2051 slots (a 3-slot tail), bf16; outputs and partials start as NaN."""
    q, latent, slots = _case(tokens, 64, 512, 2051, dtype=torch.bfloat16, cache=20000)
    want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
    got = gluon_sm90.sparse_mla(q, latent, slots, scale=1 / 16, config=config)
    assert (got.float() - want).abs().max().item() < BF16_ATOL


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("shape", [(3, 128, 100), (2, 64, 1), (5, 64, 64), (4, 64, 0),
                                   (600, 64, 40), (400, 128, 64), (300, 64, 0)],
                         ids=["two_head_blocks", "one_slot", "one_step", "empty",
                              "many_one_step_items", "many_items_two_head_blocks",
                              "many_empty_items"])
def test_odd_shapes_gpu(shape, nan_empty):
    """Two head blocks, a selection of one slot, of exactly one step, and of none; and
    programs that walk many items of one step or none (the value warpgroup's sums buffer is
    reused two items later). Outputs and partials start as NaN: one left unwritten fails."""
    tokens, heads, width = shape
    q, latent, slots = _case(tokens, heads, 512, width, dtype=torch.bfloat16, cache=500)
    want = sparse_mla_ref(q.float(), latent.float(), slots, scale=0.1)
    got = gluon_sm90.sparse_mla(q, latent, slots, scale=0.1)
    assert (got.float() - want).abs().max().item() < BF16_ATOL


@pytest.mark.gpu
@needs_sm90
def test_graph_replay_gpu():
    """A captured split launch replays on new selections: nothing on the host depends on the
    data."""
    q, latent, slots = _case(8, 64, 512, 2051, dtype=torch.bfloat16, cache=20000)
    workspace = SparseMlaWorkspace.create(8, 64, 512, 2051, q.device, num_sms(q.device),
                                          GLUON.split_config(), q.dtype)
    gluon_sm90.sparse_mla(q, latent, slots, scale=1 / 16, workspace=workspace)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gluon_sm90.sparse_mla(q, latent, slots, scale=1 / 16, workspace=workspace)
    for seed in (1, 2):
        slots.copy_(_case(8, 64, 512, 2051, cache=20000, seed=seed)[2])
        graph.replay()
        want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
        assert (out.float() - want).abs().max().item() < BF16_ATOL
