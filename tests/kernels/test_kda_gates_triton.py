"""Triton KDA gates (forget gate with beta, gated per-head RMSNorm) against kda/ref.py:
interpreter on CPU, compiled with CUDA."""

from __future__ import annotations

import pytest
import torch

from glmflash.kernels.kda import gated_rms_norm_ref, kda_gates_ref
from glmflash.kernels.kda.gates_triton import gated_rms_norm, kda_gates

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, gen, scale=1.0, dtype=torch.float32):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 2, 32), (17, 3, 24), (15, 1, 128)])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kda_gates_match_ref(tokens, heads, dim, lower_bound, dtype, nan_empty):
    gen = torch.Generator().manual_seed(tokens * 7 + heads)
    f = _randn(tokens, heads * dim, gen=gen, scale=8.0, dtype=dtype)  # softplus past 20 too
    # b is a column slice of a wider projection, as in the layer.
    small = _randn(tokens, heads + 5, gen=gen, scale=3.0, dtype=dtype)
    b = small[:, 2: 2 + heads]
    dt_bias, a_log = _randn(heads * dim, gen=gen), _randn(heads, gen=gen, scale=0.5)
    g, beta = kda_gates(f, dt_bias, a_log, b, lower_bound)
    want_g, want_beta = kda_gates_ref(f, dt_bias, a_log, b, lower_bound)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    torch.testing.assert_close(g, want_g, rtol=2e-6, atol=2e-6)
    # beta rounds to b's dtype after an fp32 sigmoid: at most one ulp apart
    torch.testing.assert_close(beta, want_beta, rtol=8e-3 if dtype == torch.bfloat16 else 2e-6,
                               atol=2e-6)


@pytest.mark.parametrize("tokens,heads,dim", [(1, 2, 32), (17, 3, 24), (15, 1, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rms_norm_matches_ref(tokens, heads, dim, dtype, nan_empty):
    gen = torch.Generator().manual_seed(tokens + dim)
    o = _randn(tokens, heads, dim, gen=gen, scale=2.0, dtype=dtype)
    gate = _randn(tokens, heads * dim, gen=gen, scale=2.0, dtype=dtype)
    weight = (1 + _randn(dim, gen=gen, scale=0.3)).to(dtype)
    got = gated_rms_norm(o, gate, weight, 1e-5)
    want = gated_rms_norm_ref(o, gate, weight, 1e-5)
    assert got.shape == (tokens, heads * dim) and not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=8e-3 if dtype == torch.bfloat16 else 3e-6,
                               atol=3e-6)
