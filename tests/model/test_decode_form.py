"""The device-resident decode form (what CUDA graphs replay) against the varlen path.

A decode batch reads its geometry only from device tensors (`pack_decode` / `decode_batch`);
the same steps through `build_forward_batch` must give the same logits and leave the same cache,
across k-pool and page boundaries, with a selection width wider than the context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glmflash.model.forward_batch import DECODE_WIDTH, decode_batch, pack_decode
from tests.conftest import PackedRunner, load_tiny

PROMPTS = {0: 37, 1: 2, 2: 13}
STEPS = 9  # crosses pool ends (kpool 4) and sequence 0's page end at 48 (pages of 16)
CPU_ATOL = 2e-5  # fp32, the selections laid out in another order


def _state_tensors(runner: PackedRunner) -> dict[str, torch.Tensor]:
    state = runner.state
    return {f"{name}.{i}": t for name in ("latent", "pool_keys", "index_tail", "recurrent", "conv")
            for i, t in getattr(state, name).items()}


def _compare(path, device: str, atol: float) -> None:
    model = load_tiny(path).to(device)
    varlen, decode = (PackedRunner(model, len(PROMPTS), device=device) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(1, 1000, (n,), generator=g).tolist() for s, n in PROMPTS.items()}
    varlen.forward(prompts)
    decode.forward(prompts)
    for step in range(STEPS):
        tokens = {s: 5 + 11 * s + step for s in PROMPTS}
        want = varlen.forward({s: [t] for s, t in tokens.items()}, all_logits=False)
        got = decode.decode(tokens, max_pools=64)
        torch.testing.assert_close(got, want, atol=atol, rtol=0)
    for name, t in _state_tensors(varlen).items():
        torch.testing.assert_close(_state_tensors(decode)[name], t, atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_decode_form_matches_varlen_cpu(tiny_dirs):
    _compare(tiny_dirs["embedded"], "cpu", CPU_ATOL)


@pytest.mark.gpu
def test_decode_form_matches_varlen_gpu(tiny_dirs):
    _compare(tiny_dirs["embedded"], "cuda", CPU_ATOL)


def test_pack_decode_round_trip():
    packed = pack_decode([7, 8, 9], [100, 200, 300], [5, 6, 7], [2, 0, 1], [0, 0, 1])
    assert packed.dtype == np.int64 and packed.size == 3 * DECODE_WIDTH
    page_table = torch.zeros(4, 2, dtype=torch.int32)
    batch = decode_batch(torch.from_numpy(packed), page_table, 16, max_pools=8)
    assert batch.input_ids.tolist() == [7, 8, 9]
    assert batch.token_slots.tolist() == [100, 200, 300]
    assert batch.logits_index.tolist() == [0, 1, 2]
    rows = batch.decode
    assert rows.positions.tolist() == [5, 6, 7] and rows.state_slots.tolist() == [2, 0, 1]
    assert rows.kda_meta.tolist() == [[0, 2, 0], [1, 0, 0], [2, 1, 1]]
    assert rows.conv_meta.tolist() == [[0, 0, 1, 2, 0], [1, 1, 2, 0, 0], [2, 2, 3, 1, 1]]
    assert rows.max_pools == 8 and batch.cu_seqlens is None
