"""Seeded KDA inputs and the run-against-ref helper shared by the KDA kernel tests."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 inputs vs the fp32 reference: 16-bit products and stored intermediates; measured <= 8.5e-3
# relative on the outputs in the interpreter, 3.7e-3 (prefill) and 4.3e-3 (decode) on the H200;
# the state is kept in fp32.
BF16_REL = 2e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), "non-finite values (unwritten output?)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, state_got: torch.Tensor,
                      state_want: torch.Tensor) -> None:
    """A bf16 run's output and final states against the reference's (or fla's)."""
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) < BF16_REL
    assert rel_err(state_got, state_want) < BF16_REL


def cu_seqlens(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def kda_inputs(lens: list[int], heads: int, dim: int, dtype: torch.dtype, decay: float = 1.0,
               seed: int = 42) -> list[torch.Tensor]:
    """q, k, v, g, beta and a state with two spare slots. The release gate has a lower bound
    of -5, g in (-5, 0); `decay` > 1 makes sub-chunks steeper than it allows."""
    gen = torch.Generator().manual_seed(seed)
    num = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = (rnd(num, heads, dim).to(dtype) for _ in range(3))
    g = -5 * torch.sigmoid(rnd(num, heads, dim)) * decay
    beta = torch.sigmoid(rnd(num, heads)).to(dtype)
    state = rnd(len(lens) + 2, heads, dim, dim)
    return [t.to(DEVICE) for t in (q, k, v, g, beta, state)]


def run_kda(lens: list[int], heads: int, dim: int, dtype: torch.dtype, decay: float = 1.0,
            **kwargs) -> tuple[torch.Tensor, ...]:
    """(out, out_ref, state, state_ref) of the Triton `kda` and `kda_ref` on one batch whose
    sequences use scrambled distinct slots, every third one fresh. `kwargs` go to the Triton
    call."""
    from glmflash.kernels.kda import kda_ref
    from glmflash.kernels.kda.triton_impl import kda

    q, k, v, g, beta, state = kda_inputs(lens, heads, dim, dtype, decay)
    cu = cu_seqlens(lens)
    # Distinct slots, as the engine gives (a batch never holds one slot twice): the kernels run
    # sequences concurrently, the reference one after another.
    order = torch.randperm(len(lens) + 2, generator=torch.Generator().manual_seed(7))
    slots = order[:len(lens)].tolist()
    fresh = [b % 3 == 1 for b in range(len(lens))]
    s_ref, s_got = state.clone(), state.clone()
    want = kda_ref(q, k, v, g, beta, s_ref, cu, slots, fresh)
    got = kda(q, k, v, g, beta, s_got, cu, slots, fresh, **kwargs)
    return got, want, s_got, s_ref


def against_fla(config=None) -> tuple[torch.Tensor, ...]:
    """Our Triton prefill (launch `config`, None: the default) and fla's chunk_kda on its
    safe-gate path (our gate's lower bound is -5), on four sequences of release width:
    (our output, fla's, our final states, fla's)."""
    import pytest

    fla_kda = pytest.importorskip("fla.ops.kda")
    from glmflash.kernels.kda.triton_impl import kda

    lens = [1000, 3000, 64, 129]
    q, k, v, g, beta, state = kda_inputs(lens, 64, 128, torch.bfloat16)
    cu = cu_seqlens(lens)
    s_got = state.clone()
    extra = {} if config is None else {"config": config}
    got = kda(q, k, v, g, beta, s_got, cu, [0, 1, 2, 3], [False] * 4, **extra)
    o_fla, s_fla = fla_kda.chunk_kda(
        q[None], k[None], v[None], g[None], beta[None], scale=128 ** -0.5,
        initial_state=state[:4].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor(cu, device=q.device), safe_gate=True, lower_bound=-5.0)
    return got, o_fla[0], s_got[:4], s_fla
