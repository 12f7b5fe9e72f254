"""Triton sparse MLA against sparse_mla/ref.py (interpreter on CPU, compiled with CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from glmflash.kernels.sparse_mla import sparse_mla_ref, triton_impl  # noqa: E402
from glmflash.kernels.sparse_mla.triton_impl import SparseMlaConfig, sparse_mla  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: summation order only (measured 4e-7 at |out| ~ 1).
FP32_ATOL = 1e-5
# bf16 operands and bf16 probabilities in the value product: measured 4e-3 at |out| ~ 1.
BF16_ATOL = 3e-2


def _case(tokens, heads, rank, cache, width, dtype, seed=42):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, rank, generator=gen).to(dtype)
    latent = torch.randn(cache, rank, generator=gen).to(dtype)
    slots = torch.randint(-1, cache, (tokens, width), generator=gen)
    if tokens > 1 and width:
        slots[1] = -1  # a query with an empty selection gets zeros
    return q.to(DEVICE), latent.to(DEVICE), slots.to(DEVICE)


CASES = {
    "decode1": (1, 4, 64, 100, 19),
    "decode3_split": (3, 4, 64, 50, 130),
    "prefill_heads20": (40, 20, 16, 64, 7),
    "rank48_empty_width": (5, 3, 48, 30, 0),
    "block_edge": (2, 16, 32, 200, 65),
    # Ranks past one score piece / value block: several output-column programs per token.
    "rank160_value_blocks": (3, 4, 160, 80, 70),
    "prefill_rank300": (70, 2, 300, 100, 9),
}


@pytest.mark.parametrize("shape", CASES.values(), ids=CASES.keys())
def test_sparse_mla_fp32(shape, nan_empty):
    q, latent, slots = _case(*shape, torch.float32)
    want = sparse_mla_ref(q, latent, slots, scale=0.1)
    got = sparse_mla(q, latent, slots, scale=0.1)
    assert (got - want).abs().max().item() < FP32_ATOL


def test_sparse_mla_bf16(nan_empty):
    q, latent, slots = _case(2, 4, 64, 100, 19, torch.bfloat16)
    want = sparse_mla_ref(q, latent, slots, scale=0.1)
    got = sparse_mla(q, latent, slots, scale=0.1)
    assert got.dtype == torch.bfloat16
    assert (got.float() - want.float()).abs().max().item() < BF16_ATOL


def test_block_sizes_fall_back_when_shared_memory_is_short(monkeypatch, nan_empty):
    """A config the GPU cannot hold raises OutOfResources at launch: the next one is used and
    remembered for the shape (sm_89 / sm_120 blocks get 99 KB, the widest config needs 115)."""
    import triton

    real_launch, tried = triton_impl._launch, []

    def launch(*args):
        tried.append(args[-2])
        if args[-2][0] == 128:  # pretend 128 output columns need too much shared memory
            raise triton.runtime.errors.OutOfResources(120_000, 101_376, "shared memory")
        return real_launch(*args)

    monkeypatch.setattr(triton_impl, "_launch", launch)
    monkeypatch.setattr(triton_impl, "_FITTED", {})
    config = SparseMlaConfig(narrow=((128, 64, None), (64, 32, 1)))
    q, latent, slots = _case(3, 4, 160, 80, 70, torch.float32)
    want = sparse_mla_ref(q, latent, slots, scale=0.1)
    for _ in range(2):
        got = sparse_mla(q, latent, slots, scale=0.1, config=config)
        assert (got - want).abs().max().item() < FP32_ATOL
    assert tried == [(128, 64, None), (64, 32, 1), (64, 32, 1)]
    triton_impl._FITTED.clear()
    with pytest.raises(triton.runtime.errors.OutOfResources):
        sparse_mla(q, latent, slots, scale=0.1, config=SparseMlaConfig(narrow=((128, 64, None),)))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 32, 300], ids=lambda t: f"T{t}")
def test_sparse_mla_release_shape_gpu(tokens):
    q, latent, slots = _case(tokens, 64, 512, 20000, 2051, torch.bfloat16)
    want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
    got = sparse_mla(q, latent, slots, scale=1 / 16)
    assert (got.float() - want).abs().max().item() < BF16_ATOL
