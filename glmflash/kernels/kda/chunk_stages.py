"""Triton KDA chunked prefill in fla's stages (README.md, "The stages"): gate cumsum and norms
with the intra-chunk products and inverse (chunk_intra.py), w/u, then the state walk with the
output (chunk_walk.py). Each stage is one kernel with its own launch shape (`StagedConfig`), so the
stages are timed one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.kda.chunk_intra import (
    _g_row,
    kda_intra_diag_kernel,
    kda_intra_off_kernel,
)
from glmflash.kernels.kda.chunk_walk import (
    CHUNK,
    PrefillBuffers,
    _chunk_ids,
    _load_rows,
    _store_rows,
    chunk_grid,
    launch_state,
)
from glmflash.kernels.triton_utils import dot_operand_type, jit, product_precision

if TYPE_CHECKING:
    from glmflash.kernels.kda.triton_impl import KdaConfig, KdaPlan


@dataclass(frozen=True)
class StagedConfig:
    """Launch shapes of the staged prefill (bench/kda_sweep.py passes its candidates)."""

    diag_warps: int = 1
    diag_key_block: int = 32
    """Channels per step of the gate stage with the diagonal blocks (`kda_intra_diag_kernel`)."""
    diag_max_registers: int | None = 128
    """A register cap for the diagonal kernel (`maxnreg`; None: the compiler's choice): more
    one-warp programs per SM for a latency-bound kernel, at the price of a few spilled bytes
    (README.md has the counts and the timing)."""
    off_warps: int = 2
    off_key_block: int = 32
    """Channels per step of the intra stage's kernel for the blocks below the diagonal."""
    solve_precision: str = "ieee"
    """`input_precision` of the inverse's 16x16 products for 16-bit models (fp32 models always
    take "ieee"); "tf32" is fla's choice and spills less."""
    inverse_bf16: bool = True
    """Store (I + diag(beta) Akk)^-1 in bf16 and take w, u as bf16 products (fla's choice) for
    16-bit models; else fp32 and TF32 products."""
    wy_warps: int = 8
    wy_block: int = 128
    """Channels (and value columns) per step of the w/u kernel."""


class StagedBuffers(NamedTuple):
    """The stages' intermediates: cumulative decay (log2) per token, head and channel, the
    inverse norms of q (times the scale) and k per token and head, the inverse T, and what the
    walk reads (chunk_walk.PrefillBuffers)."""

    g2: torch.Tensor
    rq: torch.Tensor
    rk: torch.Tensor
    tinv: torch.Tensor
    tdiag: torch.Tensor
    """The diagonal 16x16 blocks of T in fp32 `[T, H, 16]` (the intra stage's kernels')."""
    walk: PrefillBuffers


@jit
def kda_wy_kernel(q, k, v, g2, rq, rk, beta, tinv, w, u, qg, kd, gl, meta, stride_q, stride_k,
                  stride_v, stride_b, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head): w = T (beta k exp(G)), u = T (beta v), kd = k exp(G_last - G),
    exp(G_last) and qg = q exp(G) for the walk (k, q normalised, q scaled)."""
    i_c, _sub, i_h = _chunk_ids(H, 1)  # one program per (chunk, head)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    o_t = tl.arange(0, 64)
    rows = t0 + o_t
    m_t = rows < t_end
    rows = rows.to(tl.int64)
    m_a = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
    b_t = tl.load(tinv + rows[:, None] * (H * 64) + i_h * 64 + o_t[None, :], mask=m_a,
                  other=0.0).to(DOT)
    b_b = tl.load(beta + rows * stride_b + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_rk = tl.load(rk + rows * H + i_h, mask=m_t, other=0.0)
    b_rq = tl.load(rq + rows * H + i_h, mask=m_t, other=0.0)
    g2 += i_h * K
    for i_k in range(tl.cdiv(K, BK)):
        c0 = i_k * BK
        o_k = c0 + tl.arange(0, BK)
        b_g = _load_rows(g2, t0, t_end, H * K, c0, K, BK, 64)
        b_gl = _g_row(g2, t0 + 63, t_end, c0, H, K, BK)
        tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp2(b_gl), mask=o_k < K)
        b_k = _load_rows(k + i_h * K, t0, t_end, stride_k, c0, K, BK, 64) * b_rk[:, None]
        _store_rows(kd + i_h * K, b_k * tl.exp2(b_gl[None, :] - b_g), t0, t_end, H * K, c0, K,
                    BK, 64)
        b_x = b_k * tl.exp2(b_g) * b_b[:, None]
        b_w = tl.dot(b_t, b_x.to(DOT), input_precision=PREC)
        _store_rows(w + i_h * K, b_w, t0, t_end, H * K, c0, K, BK, 64)
        b_q = _load_rows(q + i_h * K, t0, t_end, stride_q, c0, K, BK, 64) * b_rq[:, None]
        _store_rows(qg + i_h * K, b_q * tl.exp2(b_g), t0, t_end, H * K, c0, K, BK, 64)
    for i_v in range(tl.cdiv(V, BV)):
        c0 = i_v * BV
        b_x = _load_rows(v + i_h * V, t0, t_end, stride_v, c0, V, BV, 64) * b_b[:, None]
        b_u = tl.dot(b_t, b_x.to(DOT), input_precision=PREC)
        _store_rows(u + i_h * V, b_u, t0, t_end, H * V, c0, V, BV, 64)


def staged_buffers(q: torch.Tensor, v: torch.Tensor, num_chunks: int,
                   config: StagedConfig) -> StagedBuffers:
    """Uninitialised buffers for every stage of one prefill (`config` picks T's dtype)."""
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    dev = q.device

    def per_token(width: int, dtype: torch.dtype = dt) -> torch.Tensor:
        return torch.empty(num_tokens, heads, width, dtype=dtype, device=dev)

    tinv_dt = dt if config.inverse_bf16 else torch.float32
    walk = PrefillBuffers(per_token(dk), per_token(dv), per_token(dk), per_token(dk),
                          per_token(CHUNK),
                          torch.empty(num_chunks, heads, dk, dtype=torch.float32, device=dev))
    norms = torch.empty(2, num_tokens, heads, dtype=torch.float32, device=dev)
    tdiag = per_token(16, torch.float32)
    return StagedBuffers(per_token(dk, torch.float32), norms[0], norms[1],
                         per_token(CHUNK, tinv_dt), tdiag, walk)


def _chunk_meta(plan: KdaPlan) -> torch.Tensor:
    return plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]


def launch_intra(q, k, g, beta, buf: StagedBuffers, plan: KdaPlan, config: StagedConfig
                 ) -> None:
    """The gate stage with the diagonal blocks, then the blocks below them and T's merge."""
    heads, dk = q.shape[1], q.shape[2]
    bk_diag = min(config.diag_key_block, triton.next_power_of_2(dk))
    bk_off = min(config.off_key_block, triton.next_power_of_2(dk))
    assert bk_diag >= 16 and bk_off >= 16, "channel steps below 16 do not fit tl.dot"
    shapes = dict(H=heads, K=dk, PREC=product_precision(q.dtype),
                  SOLVE="ieee" if q.dtype == torch.float32 else config.solve_precision)
    meta = _chunk_meta(plan)
    kda_intra_diag_kernel[chunk_grid(plan.num_chunks, CHUNK // 16, heads)](
        q, k, g, buf.g2, buf.rq, buf.rk, beta, buf.walk.aqk, buf.tinv, buf.tdiag,
        meta, dk ** -0.5, q.stride(0), k.stride(0), g.stride(0), beta.stride(0), BK=bk_diag,
        **shapes, num_warps=config.diag_warps,
        **_register_cap(config.diag_max_registers))
    kda_intra_off_kernel[chunk_grid(plan.num_chunks, 1, heads)](
        q, k, buf.g2, buf.rq, buf.rk, beta, buf.walk.aqk, buf.tinv, buf.tdiag, meta,
        q.stride(0), k.stride(0), beta.stride(0), BK=bk_off, **shapes,
        num_warps=config.off_warps)


def _register_cap(max_registers: int | None) -> dict:
    return {} if max_registers is None else {"maxnreg": max_registers}


def launch_wy(q, k, v, beta, buf: StagedBuffers, plan: KdaPlan, config: StagedConfig) -> None:
    """w, u, kd, exp(G_last) and qg for the walk, from T."""
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    bk = min(config.wy_block, triton.next_power_of_2(dk))
    bv = min(config.wy_block, triton.next_power_of_2(dv))
    wb = buf.walk
    kda_wy_kernel[chunk_grid(plan.num_chunks, 1, heads)](
        q, k, v, buf.g2, buf.rq, buf.rk, beta, buf.tinv, wb.w, wb.u, wb.qg, wb.kd, wb.gl,
        _chunk_meta(plan), q.stride(0), k.stride(0), v.stride(0), beta.stride(0), H=heads,
        K=dk, V=dv, BK=bk, BV=bv, DOT=dot_operand_type(buf.tinv.dtype),
        PREC=product_precision(q.dtype), num_warps=config.wy_warps)


def prefill(q, k, v, g, beta, state, out, plan: KdaPlan, config: KdaConfig) -> None:
    """Chunked prefill of the plan's sequences longer than one token, stage by stage."""
    staged = config.staged
    buf = staged_buffers(q, v, plan.num_chunks, staged)
    launch_intra(q, k, g, beta, buf, plan, staged)
    launch_wy(q, k, v, beta, buf, plan, staged)
    launch_state(state, out, buf.walk, plan, config)
