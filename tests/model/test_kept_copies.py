"""The copies modules derive from their weights (utils/derived.py): made once, made again when
a source is replaced or moves (its data pointer changes; updates in place are not seen), and
equal to a fresh derivation."""

from __future__ import annotations

import torch

from glmflash.kernels.fp8_gemm import dequantize_block_fp8, quantize_block_fp8
from glmflash.model.layers import Linear
from glmflash.utils.derived import kept


def test_kept_value_is_made_once_per_key():
    made = []

    class Owner:
        pass

    owner = Owner()

    def make():
        made.append(1)
        return len(made)

    assert kept(owner, "x", (1,), make) == 1
    assert kept(owner, "x", (1,), make) == 1
    assert kept(owner, "y", (1,), make) == 2  # another name, its own value
    assert kept(owner, "x", (2,), make) == 3  # the key changed
    assert len(made) == 3


def test_linear_dequantized_copy_follows_its_weight():
    lin = Linear(256, 128, torch.float32, fp8_block=128)
    w, s = quantize_block_fp8(torch.randn(128, 256))
    lin.weight.data, lin.weight_scale_inv.data = w, s
    first = lin.dequantized(torch.float32)
    assert lin.dequantized(torch.float32) is first
    assert torch.equal(first, dequantize_block_fp8(w, s, block=128, dtype=torch.float32))
    assert lin.dequantized(torch.bfloat16).dtype == torch.bfloat16  # the dtype is in the key
    w2, s2 = quantize_block_fp8(torch.randn(128, 256))
    lin.weight.data, lin.weight_scale_inv.data = w2, s2  # a new weight: made again
    assert torch.equal(lin.dequantized(torch.float32),
                       dequantize_block_fp8(w2, s2, block=128, dtype=torch.float32))
