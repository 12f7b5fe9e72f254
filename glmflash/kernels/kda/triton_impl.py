"""Triton KDA: short causal conv, fused recurrent decode step, chunked prefill (README.md).

Same signatures and semantics as ref.py. Per-sequence metadata (host lists) is packed into one
int32 tensor per distinct batch and cached, so the 34 KDA layers of a forward share one copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from glmflash.utils.device import upload

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import constexpr, dot_operand_type, jit, product_precision

# Chunk length of the prefill kernels (sub-chunks of 16 rows inside).
CHUNK = 64
# Rows of a 16-row sub-chunk use exp(G_t - a) * exp(a - G_s) around its mid-decay a; safe while
# its total decay stays under this (natural log units, factors within e^+-42), else the
# diagonal block is computed column by column.
SAFE_SPAN = constexpr(84.0)


@dataclass(frozen=True)
class KdaConfig:
    """Launch shapes of the KDA kernels (README.md, "Launch shapes", says where they come from)."""

    decode_narrow: tuple[int, int] = (32, 2)
    """Decode (value columns per program, warps) below `decode_wide_batch` sequences."""
    decode_wide: tuple[int, int] = (64, 4)
    """Decode (value columns per program, warps) from `decode_wide_batch` sequences."""
    decode_wide_batch: int = 16
    prep_warps: int = 4
    prep_key_block: int = 16
    """Key columns per step of the prep kernel."""
    state_value_block: int = 64
    """Value columns per program of the state walk."""
    state_warps: int = 4
    conv_tokens: int = 32
    """Most tokens per conv block: longer blocks spill (their history pointers are 64-bit)."""


DEFAULT_CONFIG = KdaConfig()
class KdaPlan(NamedTuple):
    """Device metadata of one batch; host counts for the grids."""

    meta: torch.Tensor  # int32, the regions below back to back
    num_decode: int
    num_prefill: int
    num_chunks: int
    max_len: int


@functools.lru_cache(maxsize=16)
def _plan(cu_seqlens: tuple[int, ...], state_slots: tuple[int, ...], is_fresh: tuple[bool, ...],
          device: torch.device) -> KdaPlan:
    """Pack [decode: tok, slot, fresh]* [prefill: start, end, slot, fresh, chunk0]* [chunk: start,
    end, seq]* into one int32 tensor."""
    decode, prefill, chunks = [], [], []
    for b, slot in enumerate(state_slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        if end - start == 1:
            decode += [start, slot, int(is_fresh[b])]
        elif end - start > 1:
            prefill += [start, end, slot, int(is_fresh[b]), len(chunks) // 3]
            for c0 in range(start, end, CHUNK):
                chunks += [c0, end, len(prefill) // 5 - 1]
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(state_slots))]
    meta = upload(decode + prefill + chunks or [0], device, torch.int32)
    return KdaPlan(meta, len(decode) // 3, len(prefill) // 5, len(chunks) // 3,
                   max(lens, default=0))


def _check_heads(t: torch.Tensor, name: str) -> None:
    assert t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2], (
        f"{name} must be [T, H, D] with contiguous heads, got strides {t.stride()}")


@jit
def kda_decode_kernel(q, k, v, g, beta, state, o, meta, scale, stride_q, stride_k, stride_v,
                      stride_g, stride_b, stride_o, H: tl.constexpr, K: tl.constexpr,
                      V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """One token per sequence: l2norm, decay, delta-rule update and output, state in place."""
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = tl.load(meta + i_b * 3).to(tl.int64)
    slot = tl.load(meta + i_b * 3 + 1).to(tl.int64)
    fresh = tl.load(meta + i_b * 3 + 2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(q + tok * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + tok * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_g = tl.load(g + tok * stride_g + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + tok * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * stride_b + i_h).to(tl.float32)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    # NOTE: scalar masks are broadcast by hand (the interpreter rejects scalar & tensor).
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV]
    b_s = b_s * tl.exp(b_g)[:, None]
    b_read = tl.sum(b_s * b_k[:, None], 0)  # [BV]
    b_delta = b_beta * (b_v - b_read)
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(p_s, b_s, mask=m_s)
    tl.store(o + tok * stride_o + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


@jit
def _row(x, o_r, r):
    """Row r of a register tile, as a vector over its columns."""
    return tl.sum(tl.where(o_r[:, None] == r, x, 0.0), 0)


@jit
def _store_rows(ptr, b_x, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
                BR: tl.constexpr):
    o_t = t0 + tl.arange(0, BR)
    o_c = tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (col0 + o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + col0 + o_c[None, :]
    tl.store(p, b_x.to(ptr.dtype.element_ty), mask=m)


@jit
def _load_rows(ptr, t0, t_end, stride_t, col0, NCOL: tl.constexpr, BCOL: tl.constexpr,
               BR: tl.constexpr):
    """Rows [t0, t0 + BR) x columns [col0, col0 + BCOL) of a row-major matrix, zero past
    t_end or NCOL, as fp32."""
    o_t = t0 + tl.arange(0, BR)
    o_c = tl.arange(0, BCOL)
    m = (o_t < t_end)[:, None] & (col0 + o_c < NCOL)[None, :]
    p = ptr + o_t.to(tl.int64)[:, None] * stride_t + col0 + o_c[None, :]
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@jit
def _diag_fallback(b_aq, b_ak, b_q, b_k, b_G, i, BT: tl.constexpr):
    """Diagonal sub-block i one column at a time, for decays too steep for the factored form."""
    o_t = tl.arange(0, BT)
    in_blk = (o_t // 16) == i
    for j in range(16):
        s = i * 16 + j
        b_ks = _row(b_k, o_t, s)
        b_gs = _row(b_G, o_t, s)
        m = (in_blk & (o_t >= s))[:, None]
        b_e = tl.exp(tl.where(m, b_G - b_gs[None, :], float("-inf"))) * b_ks[None, :]
        b_aq = tl.where(o_t[None, :] == s, b_aq + tl.sum(b_q * b_e, 1)[:, None], b_aq)
        b_ak = tl.where(o_t[None, :] == s, b_ak + tl.sum(b_k * b_e, 1)[:, None], b_ak)
    return b_aq, b_ak


@jit
def _unit_tril_inverse(b_a, BT: tl.constexpr):
    """(I + A)^-1 for strictly lower-triangular A [64, 64] in fp32 FMA products: A^64 = 0, so
    the Neumann series sum (-A)^n equals (I - A)(I + A^2)(I + A^4)...(I + A^32): ten products,
    no row loop."""
    o_t = tl.arange(0, BT)
    eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
    b_p = b_a
    b_t = eye - b_a
    for _ in range(5):
        b_p = tl.dot(b_p, b_p, input_precision="ieee")
        b_t = tl.dot(b_t, eye + b_p, input_precision="ieee")
    return b_t


@jit
def kda_chunk_prep_kernel(q, k, v, g, beta, w, u, qg, kd, aqk, gl, meta, scale,
                          stride_q, stride_k, stride_v, stride_g, stride_b,
                          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                          BK: tl.constexpr, BVF: tl.constexpr, BKC: tl.constexpr,
                          PREC: tl.constexpr, DOT: tl.constexpr):
    """Intra-chunk part of one (chunk, head) of 64 rows, for the sequential state kernel:
    Aqk, T = (I + diag(beta) Akk)^-1, w = T (beta k exp(G)), u = T (beta v), qg = q exp(G),
    kd = k exp(G_last - G) and exp(G_last). Derivation and anchoring in README.md. The A
    products take DOT operands, the inverse fp32 FMA products (README.md, "Open problems")."""
    BT: tl.constexpr = 64
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_c * 3)
    t_end = tl.load(meta + i_c * 3 + 1)
    o_t = tl.arange(0, BT)
    blk = o_t // 16
    col = i_h * K
    b_aq = tl.zeros([BT, BT], dtype=tl.float32)
    b_ak = tl.zeros([BT, BT], dtype=tl.float32)
    b_sq = tl.zeros([BT], dtype=tl.float32)
    b_sk = tl.zeros([BT], dtype=tl.float32)
    # NOTE: loops, not unrolled: unrolled, the kernel's code outgrows the instruction cache.
    for kb in range(BK // BKC):
        c0 = kb * BKC
        b_g = _load_rows(g + col, t0, t_end, stride_g, c0, K, BKC, BT)
        b_G = tl.cumsum(b_g, 0)  # [BT, BKC] decay from the chunk start
        # c_i: decay carried into 16-row sub-chunk i; each row is anchored at its own c_i.
        c1 = tl.sum(tl.where(blk[:, None] < 1, b_g, 0.0), 0)
        c2 = tl.sum(tl.where(blk[:, None] < 2, b_g, 0.0), 0)
        c3 = tl.sum(tl.where(blk[:, None] < 3, b_g, 0.0), 0)
        c4 = tl.sum(b_g, 0)
        # Anchor a_i: the mid-decay of sub-chunk i, so its own rows' factors stay within
        # e^(+-span/2) and earlier rows' column factors are <= 1; a sub-chunk whose span is too
        # steep is anchored at its start c_i instead (then every factor is <= 1).
        sp0, sp1, sp2, sp3 = tl.max(-c1, 0), tl.max(c1 - c2, 0), tl.max(c2 - c3, 0), \
            tl.max(c3 - c4, 0)
        a0 = tl.where(sp0 <= SAFE_SPAN, 0.5, 0.0) * c1
        a1 = c1 + tl.where(sp1 <= SAFE_SPAN, 0.5, 0.0) * (c2 - c1)
        a2 = c2 + tl.where(sp2 <= SAFE_SPAN, 0.5, 0.0) * (c3 - c2)
        a3 = c3 + tl.where(sp3 <= SAFE_SPAN, 0.5, 0.0) * (c4 - c3)
        b_cb = tl.where(blk[:, None] == 0, a0[None, :], a1[None, :])
        b_cb = tl.where(blk[:, None] == 2, a2[None, :], b_cb)
        b_cb = tl.where(blk[:, None] == 3, a3[None, :], b_cb)
        b_q = _load_rows(q + col, t0, t_end, stride_q, c0, K, BKC, BT)
        b_k = _load_rows(k + col, t0, t_end, stride_k, c0, K, BKC, BT)
        b_sq += tl.sum(b_q * b_q, 1)
        b_sk += tl.sum(b_k * b_k, 1)
        b_up = tl.exp(b_G - b_cb)
        b_rq = b_q * b_up
        b_rk = b_k * b_up
        for i in range(4):
            a_i = tl.where(i == 0, a0, tl.where(i == 1, a1, tl.where(i == 2, a2, a3)))
            span = tl.where(i == 0, sp0, tl.where(i == 1, sp1, tl.where(i == 2, sp2, sp3)))
            # Columns: earlier rows (factor exp(a_i - G_s) <= 1) and, while the sub-chunk's
            # decay span allows, its own rows (factor <= e^(SAFE_SPAN / 2)).
            m_col = (blk < i) | ((blk == i) & ((blk * 0.0 + span) <= SAFE_SPAN))
            b_x = tl.where(m_col[:, None], a_i[None, :] - b_G, 0.0)
            b_ct = tl.trans(tl.where(m_col[:, None], b_k * tl.exp(b_x), 0.0)).to(DOT)
            m_row = (blk == i)[:, None]
            b_aq = tl.dot(tl.where(m_row, b_rq, 0.0).to(DOT), b_ct, b_aq, input_precision=PREC)
            b_ak = tl.dot(tl.where(m_row, b_rk, 0.0).to(DOT), b_ct, b_ak, input_precision=PREC)
            if span > SAFE_SPAN:
                b_aq, b_ak = _diag_fallback(b_aq, b_ak, b_q, b_k, b_G, i, BT)
    # l2 norms as row / column scalings (eps inside the root, as the reference).
    b_rnq = scale / tl.sqrt(b_sq + 1e-6)
    b_rnk = 1.0 / tl.sqrt(b_sk + 1e-6)
    o_r = t0 + o_t
    b_b = tl.load(beta + o_r.to(tl.int64) * stride_b + i_h, mask=o_r < t_end,
                  other=0.0).to(tl.float32)
    causal = o_t[:, None] >= o_t[None, :]
    b_aq = tl.where(causal, b_aq * b_rnq[:, None] * b_rnk[None, :], 0.0)
    _store_rows(aqk + i_h * BT, b_aq, t0, t_end, H * BT, 0, BT, BT, BT)
    strict = o_t[:, None] > o_t[None, :]
    b_a = tl.where(strict, b_ak * (b_b * b_rnk)[:, None] * b_rnk[None, :], 0.0)
    b_t = _unit_tril_inverse(b_a, BT).to(DOT)
    _wy_phase(q, k, v, g, w, u, qg, kd, gl, b_t, b_b, b_rnq, b_rnk, t0, t_end, i_c, i_h,
              stride_q, stride_k, stride_v, stride_g, H, K, V, BK, BVF, BKC, PREC, DOT)


@jit
def _wy_phase(q, k, v, g, w, u, qg, kd, gl, b_t, b_b, b_rnq, b_rnk, t0, t_end, i_c, i_h,
              stride_q, stride_k, stride_v, stride_g, H: tl.constexpr, K: tl.constexpr,
              V: tl.constexpr, BK: tl.constexpr, BVF: tl.constexpr, BKC: tl.constexpr,
              PREC: tl.constexpr, DOT: tl.constexpr):
    """w, qg, kd, exp(G_last) per key block, then u per value block, from T in registers."""
    BT: tl.constexpr = 64
    BVC: tl.constexpr = BKC if BVF > BKC else BVF
    col = i_h * K
    sx = H * K
    for kb in range(BK // BKC):
        c0 = kb * BKC
        b_g = _load_rows(g + col, t0, t_end, stride_g, c0, K, BKC, BT)
        b_G = tl.cumsum(b_g, 0)
        b_last = tl.sum(b_g, 0)
        o_k = c0 + tl.arange(0, BKC)
        tl.store(gl + (i_c * H + i_h).to(tl.int64) * K + o_k, tl.exp(b_last), mask=o_k < K)
        b_e = tl.exp(b_G)
        b_q = _load_rows(q + col, t0, t_end, stride_q, c0, K, BKC, BT) * b_rnq[:, None]
        _store_rows(qg + col, b_q * b_e, t0, t_end, sx, c0, K, BKC, BT)
        b_k = _load_rows(k + col, t0, t_end, stride_k, c0, K, BKC, BT) * b_rnk[:, None]
        _store_rows(kd + col, b_k * tl.exp(b_last[None, :] - b_G), t0, t_end, sx, c0, K, BKC,
                    BT)
        b_kb = (b_k * b_e * b_b[:, None]).to(DOT)
        _store_rows(w + col, tl.dot(b_t, b_kb, input_precision=PREC), t0, t_end, sx, c0, K,
                    BKC, BT)
    for vb in range(BVF // BVC):
        c0 = vb * BVC
        b_v = _load_rows(v + i_h * V, t0, t_end, stride_v, c0, V, BVC, BT)
        b_vb = (b_v * b_b[:, None]).to(DOT)
        _store_rows(u + i_h * V, tl.dot(b_t, b_vb, input_precision=PREC), t0, t_end, H * V, c0,
                    V, BVC, BT)


@jit
def kda_chunk_state_kernel(w, u, qg, kd, aqk, gl, state, o, meta, stride_o,
                           H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
                           DOT: tl.constexpr):
    """Walk one sequence's chunks for one (head, value block): v' = u - w S, output
    o = qg S + Aqk v', then S <- exp(G_last) S + kd^T v'. Initial and final S in the slot."""
    BT: tl.constexpr = 64
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(meta + i_n * 5)
    end = tl.load(meta + i_n * 5 + 1)
    slot = tl.load(meta + i_n * 5 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 5 + 3)
    chunk0 = tl.load(meta + i_n * 5 + 4)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    m_old = m_s & ((o_k[:, None] * 0 + fresh) == 0)
    b_s = tl.load(p_s, mask=m_old, other=0.0)  # [BK, BV] fp32
    dt = DOT
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
        b_sd = b_s.to(dt)
        b_vn = b_u.to(tl.float32) - tl.dot(b_w.to(dt), b_sd, input_precision=PREC)  # [BT, BV]
        b_vnd = b_vn.to(dt)
        b_o = tl.dot(b_qg.to(dt), b_sd, input_precision=PREC)
        b_o = tl.dot(b_a.to(dt), b_vnd, b_o, input_precision=PREC)
        tl.store(o + rows[:, None] * stride_o + i_h * V + o_v[None, :],
                 b_o.to(o.dtype.element_ty), mask=m_tv)
        b_s = b_s * b_gl[:, None] + tl.dot(tl.trans(b_kd.to(dt)), b_vnd, input_precision=PREC)
    tl.store(p_s, b_s, mask=m_s)


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool],
        *, chunk_size: int = 64, config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Triton `kda_ref`: decode sequences take the fused recurrent kernel, longer ones the
    chunked pair (prep, then the sequential state walk). `chunk_size` is accepted for
    signature parity; the kernels use 64."""
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        _check_heads(t, name)
    num_tokens, heads, dk = q.shape
    dv = v.shape[2]
    assert k.shape == q.shape and g.shape == q.shape and v.shape[:2] == q.shape[:2]
    assert beta.shape == (num_tokens, heads) and beta.stride(1) == 1
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert state.shape[1:] == (heads, dk, dv)
    assert len(cu_seqlens) == len(state_slots) + 1 == len(is_fresh) + 1
    out = torch.empty(num_tokens, heads, dv, dtype=q.dtype, device=q.device)
    plan = _plan(tuple(cu_seqlens), tuple(state_slots), tuple(bool(f) for f in is_fresh),
                 q.device)
    if plan.num_decode:
        _launch_decode(q, k, v, g, beta, state, out, plan.meta, plan.num_decode, config)
    if plan.num_prefill:
        strides = (q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0))
        _prefill(q, k, v, g, beta, state, out, plan, dk ** -0.5, strides, config)
    return out


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, meta: torch.Tensor, *,
               config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """One token per sequence, rows described on the device: `meta` `[B, 3]` int32 (token row,
    state slot, fresh). Nothing is read on the host, so a CUDA graph can replay it."""
    for t, name in ((q, "q"), (k, "k"), (v, "v"), (g, "g")):
        _check_heads(t, name)
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert meta.dtype == torch.int32 and meta.is_contiguous() and meta.shape[1] == 3
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    if meta.shape[0]:
        _launch_decode(q, k, v, g, beta, state, out, meta, meta.shape[0], config)
    return out


def _launch_decode(q, k, v, g, beta, state, out, meta: torch.Tensor, num_decode: int,
                   config: KdaConfig) -> None:
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    wide = num_decode >= config.decode_wide_batch
    bv, warps = config.decode_wide if wide else config.decode_narrow
    bv = min(bv, triton.next_power_of_2(dv))
    grid = (num_decode, heads, triton.cdiv(dv, bv))
    kda_decode_kernel[grid](q, k, v, g, beta, state, out, meta, dk ** -0.5, q.stride(0),
                            k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
                            out.stride(0), H=heads, K=dk, V=dv, BK=triton.next_power_of_2(dk),
                            BV=bv, num_warps=warps)


class PrefillBuffers(NamedTuple):
    w: torch.Tensor
    u: torch.Tensor
    qg: torch.Tensor
    kd: torch.Tensor
    aqk: torch.Tensor
    gl: torch.Tensor


def _prefill_buffers(q: torch.Tensor, v: torch.Tensor, num_chunks: int) -> PrefillBuffers:
    num_tokens, heads, dk = q.shape
    dt = q.dtype if q.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    w = torch.empty(num_tokens, heads, dk, dtype=dt, device=q.device)
    aqk = torch.empty(num_tokens, heads, CHUNK, dtype=dt, device=q.device)
    return PrefillBuffers(w, torch.empty(num_tokens, heads, v.shape[2], dtype=dt, device=q.device),
                          torch.empty_like(w), torch.empty_like(w), aqk,
                          torch.empty(num_chunks, heads, dk, dtype=torch.float32,
                                      device=q.device))


def _launch_prep(q, k, v, g, beta, buf: PrefillBuffers, plan: KdaPlan, scale: float,
                 strides, config: KdaConfig = DEFAULT_CONFIG) -> None:
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    bk, bvf = triton.next_power_of_2(dk), triton.next_power_of_2(dv)
    assert bk >= 16 and bvf >= 16, "head dims below 16 do not fit tl.dot"
    chunk_meta = plan.meta[plan.num_decode * 3 + plan.num_prefill * 5:]
    kda_chunk_prep_kernel[(plan.num_chunks, heads)](
        q, k, v, g, beta, *buf, chunk_meta, scale, *strides, H=heads, K=dk, V=dv, BK=bk,
        BVF=bvf, BKC=min(config.prep_key_block, bk), PREC=product_precision(q.dtype),
        DOT=dot_operand_type(q.dtype), num_warps=config.prep_warps)


def _launch_state(state, out, buf: PrefillBuffers, plan: KdaPlan,
                  config: KdaConfig = DEFAULT_CONFIG) -> None:
    heads, dk, dv = state.shape[1:]
    bk = triton.next_power_of_2(dk)
    bv = min(config.state_value_block, triton.next_power_of_2(dv))
    seq_meta = plan.meta[plan.num_decode * 3:]
    kda_chunk_state_kernel[(plan.num_prefill, heads, triton.cdiv(dv, bv))](
        buf.w, buf.u, buf.qg, buf.kd, buf.aqk, buf.gl, state, out, seq_meta, out.stride(0),
        H=heads, K=dk, V=dv, BK=bk, BV=bv, PREC=product_precision(out.dtype),
        DOT=dot_operand_type(out.dtype), num_warps=config.state_warps)


def _prefill(q, k, v, g, beta, state, out, plan: KdaPlan, scale: float, strides,
             config: KdaConfig) -> None:
    buf = _prefill_buffers(q, v, plan.num_chunks)
    _launch_prep(q, k, v, g, beta, buf, plan, scale, strides, config)
    _launch_state(state, out, buf, plan, config)


@jit
def causal_conv1d_kernel(x, weight, conv_state, out, meta, stride_x, stride_o, C,
                         HIST: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr,
                         BC: tl.constexpr, WRITE_STATE: tl.constexpr):
    """Depthwise causal conv + SiLU over one (token block of one sequence, channel block).
    History comes from the slot (zeros if fresh); with WRITE_STATE the block holds its whole
    sequence and also stores the new history."""
    i_blk, i_c = tl.program_id(0), tl.program_id(1)
    t0 = tl.load(meta + i_blk * 5)
    start = tl.load(meta + i_blk * 5 + 1)
    end = tl.load(meta + i_blk * 5 + 2)
    slot = tl.load(meta + i_blk * 5 + 3).to(tl.int64)
    fresh = tl.load(meta + i_blk * 5 + 4)
    o_t = t0 + tl.arange(0, BT)
    o_c = i_c * BC + tl.arange(0, BC)
    m_c = o_c < C
    m_t = o_t < end
    p_hist = conv_state + (slot * C + o_c) * HIST
    b_acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(HIST + 1):
        # Input at position t - HIST + j: a token of this sequence, or history column HIST + src.
        src = o_t - HIST + j
        in_seq = src >= start
        b_x = tl.load(x + src.to(tl.int64)[:, None] * stride_x + o_c[None, :],
                      mask=(in_seq & m_t)[:, None] & m_c[None, :], other=0.0)
        hcol = HIST + src - start
        m_h = (~in_seq & m_t & ((src * 0 + fresh) == 0))[:, None] & m_c[None, :]
        b_h = tl.load(p_hist[None, :] + hcol[:, None], mask=m_h, other=0.0).to(x.dtype.element_ty)
        b_w = tl.load(weight + o_c * (HIST + 1) + j, mask=m_c, other=0.0)
        b_acc += (b_x.to(tl.float32) + b_h.to(tl.float32)) * b_w[None, :]
    b_out = b_acc / (1.0 + tl.exp(-b_acc))
    tl.store(out + o_t.to(tl.int64)[:, None] * stride_o + o_c[None, :],
             b_out.to(out.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])
    if WRITE_STATE:
        _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, m_c, HIST,
                           HP)


@jit
def _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, m_c,
                       HIST: tl.constexpr, HP: tl.constexpr):
    """New history = the last HIST entries of [old history | tokens]; all loads before stores."""
    o_j = tl.arange(0, HP)
    m_j = o_j < HIST
    pos = end - HIST + o_j  # [HP] absolute token index of each new column
    in_seq = pos >= start
    m_x = (in_seq & m_j)[None, :] & m_c[:, None]
    b_x = tl.load(x + pos.to(tl.int64)[None, :] * stride_x + o_c[:, None], mask=m_x, other=0.0)
    p_hist = conv_state + (slot * C + o_c)[:, None] * HIST
    hcol = HIST + pos - start
    m_h = (~in_seq & m_j & ((pos * 0 + fresh) == 0))[None, :] & m_c[:, None]
    b_h = tl.load(p_hist + hcol[None, :], mask=m_h, other=0.0)
    b_new = tl.where(in_seq[None, :], b_x.to(conv_state.dtype.element_ty), b_h)
    tl.store(p_hist + o_j[None, :], b_new, mask=m_c[:, None] & m_j[None, :])


@jit
def causal_conv1d_state_kernel(x, conv_state, meta, stride_x, C, HIST: tl.constexpr,
                               HP: tl.constexpr, BC: tl.constexpr):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    start = tl.load(meta + i_n * 4)
    end = tl.load(meta + i_n * 4 + 1)
    slot = tl.load(meta + i_n * 4 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 4 + 3)
    o_c = i_c * BC + tl.arange(0, BC)
    _conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, o_c < C, HIST,
                       HP)


@functools.lru_cache(maxsize=16)
def _conv_plan(cu_seqlens: tuple[int, ...], state_slots: tuple[int, ...],
               is_fresh: tuple[bool, ...], block: int, device: torch.device
               ) -> tuple[torch.Tensor, int, int]:
    """[block: t0, start, end, slot, fresh]* then [seq: start, end, slot, fresh]*, as int32."""
    blocks, seqs = [], []
    for b, slot in enumerate(state_slots):
        start, end = cu_seqlens[b], cu_seqlens[b + 1]
        seqs += [start, end, slot, int(is_fresh[b])]
        for t0 in range(start, end, block):
            blocks += [t0, start, end, slot, int(is_fresh[b])]
    meta = upload(blocks + seqs or [0], device, torch.int32)
    return meta, len(blocks) // 5, len(seqs) // 4


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool], *,
                  config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Triton `causal_conv1d_ref`: x `[T, C]`, weight `[C, K]` fp32, conv_state `[S, C, K-1]`."""
    num_tokens, channels = x.shape
    hist = weight.shape[1] - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert conv_state.shape[1:] == (channels, hist) and hist >= 1
    out = torch.empty(num_tokens, channels, dtype=x.dtype, device=x.device)
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(state_slots))]
    max_len = max(lens, default=0)
    block = min(config.conv_tokens, triton.next_power_of_2(max(max_len, 1)))
    meta, num_blocks, num_seqs = _conv_plan(tuple(cu_seqlens), tuple(state_slots),
                                            tuple(bool(f) for f in is_fresh), block, x.device)
    if num_seqs == 0:
        return out
    bc = 256 if block <= 16 else 128
    fused = max_len <= block and min(lens) >= 1
    grid_c = triton.cdiv(channels, bc)
    if num_blocks:
        causal_conv1d_kernel[(num_blocks, grid_c)](
            x, weight, conv_state, out, meta, x.stride(0), out.stride(0), channels,
            HIST=hist, HP=triton.next_power_of_2(hist), BT=block, BC=bc, WRITE_STATE=fused,
            num_warps=4)
    if not fused:
        causal_conv1d_state_kernel[(num_seqs, grid_c)](
            x, conv_state, meta[num_blocks * 5:], x.stride(0), channels, HIST=hist,
            HP=triton.next_power_of_2(hist), BC=bc, num_warps=4)
    return out


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                         meta: torch.Tensor) -> torch.Tensor:
    """One token per sequence, rows described on the device: `meta` `[B, 5]` int32 (token row,
    its start, its end, state slot, fresh), as `_conv_plan` lays out single-token blocks."""
    channels = x.shape[1]
    hist = weight.shape[1] - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert meta.dtype == torch.int32 and meta.is_contiguous() and meta.shape[1] == 5
    out = torch.empty_like(x)
    if meta.shape[0]:
        causal_conv1d_kernel[(meta.shape[0], triton.cdiv(channels, 256))](
            x, weight, conv_state, out, meta, x.stride(0), out.stride(0), channels, HIST=hist,
            HP=triton.next_power_of_2(hist), BT=1, BC=256, WRITE_STATE=True, num_warps=4)
    return out


__all__ = ["DEFAULT_CONFIG", "KdaConfig", "causal_conv1d", "causal_conv1d_decode", "kda",
           "kda_decode"]
