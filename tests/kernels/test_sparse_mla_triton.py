"""Triton sparse MLA against sparse_mla/ref.py (interpreter on CPU, compiled with CUDA).

Every regime runs on odd widths (one step, a step minus and plus one, tails), with -1 padding,
queries whose selections differ in length, empty selections and splits that see no slot.
"""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.sparse_mla import sparse_mla_ref, triton_impl
from glmflash.kernels.sparse_mla.plan import (
    SparseMlaConfig,
    SparseMlaLaunch,
    SparseMlaWorkspace,
)
from glmflash.kernels.sparse_mla.triton_impl import sparse_mla
from glmflash.kernels.triton_utils import num_sms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: summation order only (measured 4e-7 at |out| ~ 1).
FP32_ATOL = 1e-5
# bf16 operands and bf16 probabilities in the value product: measured 4e-3 at |out| ~ 1.
BF16_ATOL = 3e-2

# Interpreter shapes: 16-slot steps, so widths 15/16/17 sit on a step boundary.
STEP = SparseMlaLaunch(16, 2)
CONFIGS = {
    # One program per query and head block: the whole selection.
    "whole": SparseMlaConfig(prefill=(STEP,), decode=(STEP,), waves=0.25),
    # Split over the slots (one step per split at least), merged by the combine kernel.
    "split": SparseMlaConfig(prefill=(STEP,), decode=(STEP,), waves=16),
    # Split, merged with a small tile budget (several column blocks per head block).
    "small_tiles": SparseMlaConfig(prefill=(STEP,), decode=(STEP,), waves=16,
                                   combine_elements=256),
    # 32-slot steps with 16-slot steps over the tail.
    "tail": SparseMlaConfig(prefill=(SparseMlaLaunch(32, 2, tail_slots=16),),
                            decode=(SparseMlaLaunch(32, 2, tail_slots=16),), waves=16),
    # fp32 partials whatever the output's dtype.
    "fp32_partials": SparseMlaConfig(prefill=(STEP,), decode=(STEP,), waves=16,
                                     partial_dtype=torch.float32),
}


def _selection(tokens: int, width: int, cache: int, gen: torch.Generator) -> torch.Tensor:
    """Distinct slots per query, best first then -1, as the indexer writes them: lengths cycle
    through full, empty, one, and random; some -1 inside; one query's first 16 slots all -1 (a
    split that sees no slot)."""
    slots = torch.full((tokens, width), -1, dtype=torch.long)
    for t in range(tokens):
        length = (width, 0, 1, int(torch.randint(0, width + 1, (1,), generator=gen)))[t % 4]
        slots[t, :length] = torch.randperm(cache, generator=gen)[:length]
    slots[torch.rand(tokens, width, generator=gen) < 0.1] = -1
    if tokens > 4 and width > 16:
        slots[4, :16] = -1
    return slots


def _case(tokens, heads, rank, width, dtype=torch.float32, cache=300, seed=42):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    latent = torch.randn(cache, rank, generator=gen).to(dtype)
    slots = _selection(tokens, width, cache, gen)
    return q.to(DEVICE), latent.to(DEVICE), slots.to(DEVICE)


def _check(shape, config, atol=FP32_ATOL, dtype=torch.float32, workspace=None):
    q, latent, slots = _case(*shape, dtype=dtype)
    want = sparse_mla_ref(q, latent, slots, scale=0.1).float()
    got = sparse_mla(q, latent, slots, scale=0.1, config=config, workspace=workspace)
    assert got.dtype == dtype
    err = (got.float() - want).abs().max().item()
    assert err < atol, f"max error {err}"
    return q, latent, slots, got


WIDTHS = [1, 15, 16, 17, 47, 49]


@pytest.mark.parametrize("width", WIDTHS, ids=lambda w: f"W{w}")
@pytest.mark.parametrize("regime", ["whole", "split", "small_tiles", "tail"])
def test_widths(regime, width, nan_empty):
    _check((6, 4, 32, width), CONFIGS[regime])


CASES = {
    "one_query_tail": ((1, 4, 64, 70), "tail"),
    "rank48_heads3": ((5, 3, 48, 33), "small_tiles"),
    "two_head_blocks": ((2, 70, 16, 40), "split"),
    "heads20_many_queries": ((40, 20, 16, 7), "whole"),
    "empty_width": ((3, 4, 32, 0), "split"),
    "two_head_blocks_rank32": ((2, 70, 32, 40), "small_tiles"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_shapes(case, nan_empty):
    shape, regime = case
    _check(shape, CONFIGS[regime])


@pytest.mark.parametrize("regime", ["small_tiles", "fp32_partials"])
def test_bf16(regime, nan_empty):
    """bf16 launches: partials in bf16 (the default) and in fp32."""
    _check((6, 4, 64, 40), CONFIGS[regime], atol=BF16_ATOL, dtype=torch.bfloat16)


def test_workspace_is_reused_and_bounds_the_splits(nan_empty):
    """Two launches share one workspace; a workspace too small for the wanted splits gives
    fewer splits, not a wrong answer."""
    config = CONFIGS["small_tiles"]
    q, latent, slots = _case(6, 4, 32, 49)
    workspace = SparseMlaWorkspace.create(6, 4, 32, 49, q.device, num_sms(q.device), config,
                                          q.dtype)
    assert workspace.partial_out.shape[0] > 6  # the launches below do split
    assert workspace.partial_out.dtype == torch.float32  # the output's dtype
    first = _check((6, 4, 32, 49), config, workspace=workspace)[3]
    again = sparse_mla(q, latent, slots, scale=0.1, config=config, workspace=workspace)
    assert torch.equal(first, again)
    small = SparseMlaWorkspace(workspace.partial_out[:12], workspace.partial_lse[:12])
    _check((6, 4, 32, 49), config, workspace=small)


def test_launch_shapes_fall_back_when_shared_memory_is_short(monkeypatch, nan_empty):
    """A launch shape the GPU cannot hold raises OutOfResources at launch: the next one is used
    and remembered for the shape (sm_89 / sm_120 blocks get 99 KB)."""
    import triton

    real_launch, tried = triton_impl._launch, []

    def launch(*args):
        shape = args[5]
        tried.append(shape)
        if shape.block_slots == 32:  # pretend 32-slot steps need too much shared memory
            raise triton.runtime.errors.OutOfResources(120_000, 101_376, "shared memory")
        return real_launch(*args)

    monkeypatch.setattr(triton_impl, "_launch", launch)
    monkeypatch.setattr(triton_impl, "_FITTED", {})
    wide, narrow = SparseMlaLaunch(32, 2), SparseMlaLaunch(16, 1)
    config = SparseMlaConfig(prefill=(wide, narrow), decode=(wide, narrow), waves=0.25)
    for _ in range(2):
        _check((3, 4, 32, 40), config)
    assert tried == [wide, narrow, narrow]
    triton_impl._FITTED.clear()
    with pytest.raises(triton.runtime.errors.OutOfResources):
        sparse_mla(*_case(3, 4, 32, 40), scale=0.1,
                   config=SparseMlaConfig(prefill=(wide,), decode=(wide,), waves=0.25))


RELEASE_CONFIGS = {
    "default": SparseMlaConfig(),
    # The fallback shapes of smaller shared memories, and fp32 partials.
    "steps32": SparseMlaConfig(prefill=(SparseMlaLaunch(32, 2, tail_slots=16),),
                               decode=(SparseMlaLaunch(32, 2, tail_slots=16),)),
    "steps16": SparseMlaConfig(prefill=(SparseMlaLaunch(16, 2),), decode=(SparseMlaLaunch(16, 2),)),
    "fp32_partials": SparseMlaConfig(partial_dtype=torch.float32),
}


@pytest.mark.gpu
@pytest.mark.parametrize("config", RELEASE_CONFIGS.values(), ids=RELEASE_CONFIGS.keys())
@pytest.mark.parametrize("tokens", [1, 8, 32, 300, 4096], ids=lambda t: f"T{t}")
def test_release_shape_gpu(tokens, config):
    """64 heads x 512, 2051 slots, bf16: unsplit from a wave of queries on, split below (every
    default launch has 16-wide products over the 3-slot tail)."""
    q, latent, slots = _case(tokens, 64, 512, 2051, dtype=torch.bfloat16, cache=20000)
    want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
    got = sparse_mla(q, latent, slots, scale=1 / 16, config=config)
    assert (got.float() - want).abs().max().item() < BF16_ATOL


@pytest.mark.gpu
def test_graph_replay_gpu():
    """A captured split launch replays on new selections: nothing on the host depends on the
    data."""
    config = SparseMlaConfig()
    q, latent, slots = _case(8, 64, 512, 2051, dtype=torch.bfloat16, cache=20000)
    workspace = SparseMlaWorkspace.create(8, 64, 512, 2051, q.device, num_sms(q.device), config,
                                          q.dtype)
    sparse_mla(q, latent, slots, scale=1 / 16, config=config, workspace=workspace)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sparse_mla(q, latent, slots, scale=1 / 16, config=config, workspace=workspace)
    for seed in (1, 2):
        slots.copy_(_case(8, 64, 512, 2051, cache=20000, seed=seed)[2])
        graph.replay()
        want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
        assert (out.float() - want).abs().max().item() < BF16_ATOL
