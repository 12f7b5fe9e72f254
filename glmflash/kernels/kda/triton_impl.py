"""Triton KDA: short causal conv, fused recurrent decode step, and the launcher that splits a
packed batch between the decode kernel and the chunked prefill (chunk_stages.py; README.md).

Same signatures and semantics as ref.py. Per-sequence metadata (host lists) is packed into one
int32 tensor per distinct batch and cached, so the 34 KDA layers of a forward share one copy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from glmflash.kernels.kda import chunk_stages
from glmflash.kernels.kda.chunk_stages import StagedConfig
from glmflash.kernels.kda.chunk_walk import CHUNK
from glmflash.kernels.kda.gates_triton import log_decay
from glmflash.kernels.kda.ref import GateParams
from glmflash.utils.device import upload

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit


@dataclass(frozen=True)
class KdaConfig:
    """Launch shapes of the KDA kernels (README.md, "Launch shapes", says where they come from)."""

    decode_narrow: tuple[int, int] = (32, 2)
    """Decode (value columns per program, warps) below `decode_wide_batch` sequences."""
    decode_wide: tuple[int, int] = (64, 4)
    """Decode (value columns per program, warps) from `decode_wide_batch` sequences."""
    decode_wide_batch: int = 16
    staged: StagedConfig = StagedConfig()
    """Launch shapes of the chunked prefill's stages before the walk (chunk_stages.py)."""
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
    end, seq]* into one int32 tensor. Sequences with tokens must own distinct slots: the
    kernels run them concurrently, where the reference would chain two that share one."""
    used = [s for b, s in enumerate(state_slots) if cu_seqlens[b + 1] > cu_seqlens[b]]
    assert len(set(used)) == len(used), f"a state slot appears twice in one batch: {used}"
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
def kda_decode_kernel(q, k, v, g, beta, state, o, meta, dt_bias, a_log, lower_bound, scale,
                      stride_q, stride_k, stride_v, stride_g, stride_b, stride_o,
                      H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                      BV: tl.constexpr, GATES: tl.constexpr, HAS_LB: tl.constexpr):
    """One token per sequence: l2norm, decay, delta-rule update and output, state in place."""
    i_b, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok = tl.load(meta + i_b * 3).to(tl.int64)
    slot = tl.load(meta + i_b * 3 + 1).to(tl.int64)
    fresh = tl.load(meta + i_b * 3 + 2)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_s = (o_k < K)[:, None] & (o_v < V)[None, :]
    p_s = state + ((slot * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    b_s = tl.load(p_s, mask=m_s & (splat(o_k, fresh)[:, None] == 0), other=0.0)  # [BK, BV]
    b_s = kda_token_step(q, k, v, g, beta, o, b_s, tok, i_h, o_k, o_v, dt_bias, a_log,
                         lower_bound, scale, stride_q, stride_k, stride_v, stride_g, stride_b,
                         stride_o, K, V, GATES, HAS_LB)
    tl.store(p_s, b_s, mask=m_s)


@jit
def splat(like, value):
    """A scalar as a vector shaped `like` (the interpreter rejects scalar & tensor masks)."""
    return like * 0 + value


@jit
def token_gates(g, beta, tok, i_h, o_k, dt_bias, a_log, lower_bound, stride_g, stride_b,
                K: tl.constexpr, GATES: tl.constexpr, HAS_LB: tl.constexpr):
    """Token `tok`'s log-decay `[BK]` and beta of head `i_h` (fp32): loaded, or with GATES
    formed from the pre-activations as kda_gates_kernel forms them (`log_decay`, so the same
    bits)."""
    m_k = o_k < K
    b_g = tl.load(g + tok * stride_g + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + tok * stride_b + i_h).to(tl.float32)
    if GATES:
        b_g = log_decay(b_g, dt_bias, a_log, lower_bound, i_h, o_k, m_k, K, HAS_LB)
        b_beta = tl.sigmoid(b_beta).to(beta.dtype.element_ty).to(tl.float32)
    return b_g, b_beta


@jit
def kda_token_step(q, k, v, g, beta, o, b_s, tok, i_h, o_k, o_v, dt_bias, a_log, lower_bound,
                   scale, stride_q, stride_k, stride_v, stride_g, stride_b, stride_o,
                   K: tl.constexpr, V: tl.constexpr, GATES: tl.constexpr, HAS_LB: tl.constexpr):
    """Token `tok`'s step of head `i_h` on the state tile `b_s` `[BK, BV]` (value columns
    `o_v`): l2norm of q and k, per-channel decay, delta-rule update; writes the output columns
    and returns the new tile. The decode and verify kernels share it, so a verify's states are
    a decode step's bit for bit."""
    m_k, m_v = o_k < K, o_v < V
    b_q = tl.load(q + tok * stride_q + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + tok * stride_k + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + tok * stride_v + i_h * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_g, b_beta = token_gates(g, beta, tok, i_h, o_k, dt_bias, a_log, lower_bound, stride_g,
                              stride_b, K, GATES, HAS_LB)
    b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6) * scale
    b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
    b_s = b_s * tl.exp(b_g)[:, None]
    b_read = tl.sum(b_s * b_k[:, None], 0)  # [BV]
    b_delta = b_beta * (b_v - b_read)
    b_s = b_s + b_k[:, None] * b_delta[None, :]
    b_o = tl.sum(b_s * b_q[:, None], 0)
    tl.store(o + tok * stride_o + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    return b_s


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        state: torch.Tensor, cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool],
        *, chunk_size: int = 64, config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """Triton `kda_ref`: decode sequences take the fused recurrent kernel, longer ones the
    chunked prefill's stages (chunk_stages.py, ending in the sequential state walk).
    `chunk_size` is accepted for signature parity; the kernels use 64."""
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
        chunk_stages.prefill(q, k, v, g, beta, state, out, plan, config)
    return out


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, meta: torch.Tensor,
               out: torch.Tensor | None = None, *, gates: GateParams | None = None,
               config: KdaConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """One token per sequence, rows described on the device: `meta` `[B, 3]` int32 (token row,
    state slot, fresh). Nothing is read on the host, so a CUDA graph can replay it. The
    output's rows are the inputs' (`out`, `[T, H, dv]`, when given): only the meta's rows are
    written. With `gates`, g and beta are the gates' pre-activations (`GateParams`)."""
    for t, name in ((q, "q"), (k, "k"), (v, "v")):
        _check_heads(t, name)
    assert state.dtype == torch.float32 and state.is_contiguous()
    assert meta.dtype == torch.int32 and meta.is_contiguous() and meta.shape[1] == 3
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
    # The kernel steps heads by dv within a row: rows may be strided, heads not.
    assert out.shape == (q.shape[0], q.shape[1], v.shape[2])
    assert out.stride(2) == 1 and out.stride(1) == v.shape[2]
    if meta.shape[0]:
        _launch_decode(q, k, v, g, beta, state, out, meta, meta.shape[0], config, gates)
    return out


class GateOperands(NamedTuple):
    """The gate arguments of the decode and verify kernels (`gate_operands`)."""

    dt_bias: torch.Tensor
    a_log: torch.Tensor
    bound: float
    fused: bool  # GATES: g and beta are pre-activations, the kernel forms the gates
    has_lb: bool  # HAS_LB
    stride_g: int
    stride_b: int


def gate_operands(g: torch.Tensor, beta: torch.Tensor, gates: GateParams | None) -> GateOperands:
    """The decode and verify kernels' gate arguments: the gates as given (g and beta), or
    their pre-activations and parameters."""
    heads = beta.shape[1]
    assert beta.stride(1) == 1 and g.stride(-1) == 1
    if gates is None:
        assert g.dim() == 3 and g.stride(1) == g.shape[2], "g must be [T, H, dk], heads dense"
        return GateOperands(g, g, 0.0, False, False, g.stride(0), beta.stride(0))
    assert g.dim() == 2 and g.shape[1] % heads == 0, "f must be [T, H * dk]"
    assert gates.dt_bias.dtype == torch.float32 and gates.dt_bias.is_contiguous()
    bound = gates.lower_bound
    return GateOperands(gates.dt_bias, gates.a_log, 0.0 if bound is None else float(bound), True,
                        bound is not None, g.stride(0), beta.stride(0))


def decode_shape(config: KdaConfig, num_seqs: int, dv: int) -> tuple[int, int]:
    """(value columns a program, warps) of a decode or verify launch over `num_seqs`
    sequences: the wide shape from `config.decode_wide_batch` sequences, else the narrow one
    (decode and verify of the same sequences take the same shape, so the same sums)."""
    bv, warps = config.decode_wide if num_seqs >= config.decode_wide_batch \
        else config.decode_narrow
    return min(bv, triton.next_power_of_2(dv)), warps


def _launch_decode(q, k, v, g, beta, state, out, meta: torch.Tensor, num_decode: int,
                   config: KdaConfig, gates: GateParams | None = None) -> None:
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    bv, warps = decode_shape(config, num_decode, dv)
    ops = gate_operands(g, beta, gates)
    grid = (num_decode, heads, triton.cdiv(dv, bv))
    kda_decode_kernel[grid](q, k, v, g, beta, state, out, meta, ops.dt_bias, ops.a_log,
                            ops.bound, dk ** -0.5, q.stride(0), k.stride(0), v.stride(0),
                            ops.stride_g, ops.stride_b, out.stride(0), H=heads, K=dk, V=dv,
                            BK=triton.next_power_of_2(dk), BV=bv, GATES=ops.fused,
                            HAS_LB=ops.has_lb, num_warps=warps)


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
    o_c = i_c * BC + tl.arange(0, BC)
    conv_block(x, weight, conv_state, out, stride_x, stride_o, C, t0, start, end, slot, fresh,
               o_c, HIST, BT, BC)
    if WRITE_STATE:
        conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, o_c < C,
                           HIST, HP)


@jit
def conv_block(x, weight, conv_state, out, stride_x, stride_o, C, t0, start, end, slot, fresh,
               o_c, HIST: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """The outputs of tokens t0 .. t0 + BT - 1 (those before `end`) of the sequence that
    starts at `start`, over channels `o_c`: inputs before `start` come from the slot's history
    (zeros if fresh)."""
    o_t = t0 + tl.arange(0, BT)
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


@jit
def conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, m_c,
                      HIST: tl.constexpr, HP: tl.constexpr):
    """New history = the last HIST entries of [old history | tokens]; all loads before stores.
    Returns it `[BC, HP]` (columns past HIST are padding)."""
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
    return b_new


@jit
def causal_conv1d_state_kernel(x, conv_state, meta, stride_x, C, HIST: tl.constexpr,
                               HP: tl.constexpr, BC: tl.constexpr):
    i_n, i_c = tl.program_id(0), tl.program_id(1)
    start = tl.load(meta + i_n * 4)
    end = tl.load(meta + i_n * 4 + 1)
    slot = tl.load(meta + i_n * 4 + 2).to(tl.int64)
    fresh = tl.load(meta + i_n * 4 + 3)
    o_c = i_c * BC + tl.arange(0, BC)
    conv_state_update(x, conv_state, stride_x, C, start, end, slot, fresh, o_c, o_c < C, HIST,
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
                         meta: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One token per sequence, rows described on the device: `meta` `[B, 5]` int32 (token row,
    its start, its end, state slot, fresh), as `_conv_plan` lays out single-token blocks. The
    output's rows are x's (`out` when given): only the meta's rows are written."""
    channels = x.shape[1]
    hist = weight.shape[1] - 1
    assert x.stride(1) == 1 and weight.is_contiguous() and conv_state.is_contiguous()
    assert meta.dtype == torch.int32 and meta.is_contiguous() and meta.shape[1] == 5
    if out is None:
        out = torch.empty_like(x)
    assert out.shape == x.shape and out.stride(1) == 1
    if meta.shape[0]:
        causal_conv1d_kernel[(meta.shape[0], triton.cdiv(channels, 256))](
            x, weight, conv_state, out, meta, x.stride(0), out.stride(0), channels, HIST=hist,
            HP=triton.next_power_of_2(hist), BT=1, BC=256, WRITE_STATE=True, num_warps=4)
    return out


__all__ = ["DEFAULT_CONFIG", "GateParams", "KdaConfig", "causal_conv1d", "causal_conv1d_decode",
           "kda", "kda_decode"]
