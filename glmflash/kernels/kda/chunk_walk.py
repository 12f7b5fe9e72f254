"""The last stage of the Triton KDA chunked prefill (chunk_stages.py runs them all): the state
walk per (sequence, head, value block), with the output as it goes, and the row load and store
helpers the stages share. README.md ("Chunked form") derives it; ref.py's `_chunk` is the spec.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import dot_operand_type, jit, product_precision

if TYPE_CHECKING:
    from glmflash.kernels.kda.triton_impl import KdaConfig, KdaPlan

# Tokens per chunk; the intra stage splits a chunk into four 16-row sub-chunks.
CHUNK = 64


@jit
def _load_rows(ptr, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
               BR: tl.constexpr):
    """Rows [t0, t0 + BR) x columns [col0, col0 + BCOL) of a row-major matrix, zero past
    t_end or NCOL, as fp32."""
    o_t = t0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + o_c[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@jit
def _store_rows(ptr, b_x, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
                BR: tl.constexpr):
    """Stores b_x `[BR, BCOL]` at rows [t0, t0 + BR) x columns [col0, col0 + BCOL), rows past
    t_end and columns past NCOL left alone."""
    o_t = t0 + tl.arange(0, BR)
    o_c = col0 + tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + o_c[None, :]
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m)


@jit
def _chunk_ids(H: tl.constexpr, SUBS: tl.constexpr):
    """(chunk, sub-chunk, head) of this program of a per-chunk stage (`chunk_grid`). The grid
    is one axis ordered head, then sub-chunk, then chunk, so that the programs resident
    together cover a few whole chunks (the same rows for every head: contiguous memory) rather
    than one head's rows across many chunks."""
    pid = tl.program_id(0)
    return pid // (H * SUBS), (pid // H) % SUBS, pid % H


def chunk_grid(num_chunks: int, subs: int, heads: int) -> tuple[int]:
    """The launch grid `_chunk_ids` decodes: one axis over (chunk, sub-chunk, head)."""
    return (num_chunks * subs * heads,)


@jit
def _walk_start(state, meta, i_n, i_h, o_k, o_v, m_s, H: tl.constexpr, K: tl.constexpr,
                V: tl.constexpr):
    """Where the state walk of prefill sequence i_n starts: its token range and first chunk
    (`meta` rows of start, end, slot, fresh, chunk0), and head i_h's state block in its slot,
    as pointers and as values (zeros for a fresh sequence)."""
    start = tl.load(meta + i_n * 5)
    end = tl.load(meta + i_n * 5 + 1)
    slot = tl.load(meta + i_n * 5 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 5 + 3)
    chunk0 = tl.load(meta + i_n * 5 + 4)
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    # NOTE: scalar masks are broadcast by hand (the interpreter rejects scalar & tensor).
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32
    return start, end, chunk0, p_s, b_s


@jit
def kda_chunk_state_kernel(w, u, qg, kd, aqk, gl, state, o, meta, stride_o,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                           DOT: tl.constexpr):
    """Walk one sequence's chunks for one (head, value block): v' = u - w S, output
    o = qg S + Aqk v', then S <- exp(G_last) S + kd^T v'. Initial and final S in the slot."""
    BT: tl.constexpr = 64
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    start, end, chunk0, p_s, b_s = _walk_start(state, meta, i_n, i_h, o_k, o_v, m_s, H, K, V)
    num_chunks = tl.cdiv(end - start, BT)
    for i_c in tl.range(num_chunks, num_stages=2):
        rows = start + i_c * BT + o_t
        m_t = rows < end
        rows = rows.to(tl.int64)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        p_x = rows[:, None] * (H * K) + i_h * K + o_k[None, :]
        b_w = tl.load(w + p_x, mask=m_tk, other=0.0)
        b_qg = tl.load(qg + p_x, mask=m_tk, other=0.0)
        b_kd = tl.load(kd + p_x, mask=m_tk, other=0.0)
        b_u = tl.load(u + rows[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        m_a = m_t[:, None] & (o_t[None, :] <= o_t[:, None])
        b_a = tl.load(aqk + rows[:, None] * (H * BT) + i_h * BT + o_t[None, :], mask=m_a,
                      other=0.0)
        b_gl = tl.load(gl + ((chunk0 + i_c) * H + i_h).to(tl.int64) * K + o_k, mask=m_k,
                       other=0.0)
        b_sd = b_s.to(DOT)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(DOT), b_sd, input_precision=PREC)  # [BT, BV]
        b_vnd = b_vn.to(DOT)
        b_o = tl.dot(b_qg.to(DOT), b_sd, input_precision=PREC)
        b_o = tl.dot(b_a.to(DOT), b_vnd, b_o, input_precision=PREC)
        tl.store(o + rows[:, None] * stride_o + i_h * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_gl[:, None] + tl.dot(tl.trans(b_kd.to(DOT)), b_vnd, input_precision=PREC)
    tl.store(p_s, b_s, mask=m_s)


class PrefillBuffers(NamedTuple):
    """What the stages before it hand the state walk: per token and head w, u, qg, kd and a
    row of Aqk, per chunk and head exp(G_last)."""

    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    aqk: torch.Tensor
    gl: torch.Tensor


def launch_state(state, out, buf: PrefillBuffers, plan: KdaPlan, config: KdaConfig) -> None:
    """The state walk over the plan's prefill sequences, from the earlier stages' buffers."""
    heads, dk, dv = state.shape[1:]
    bk = triton.next_power_of_2(dk)
    bv = min(config.state_value_block, triton.next_power_of_2(dv))
    seq_meta = plan.meta[plan.num_decode * 3:]
    kda_chunk_state_kernel[(plan.num_prefill, heads, triton.cdiv(dv, bv))](
        buf.w, buf.u, buf.qg, buf.kd, buf.aqk, buf.gl, state, out, seq_meta, out.stride(0),
        H=heads, K=dk, V=dv, BK=bk, BV=bv, PREC=product_precision(out.dtype),
        DOT=dot_operand_type(out.dtype), num_warps=config.state_warps)
