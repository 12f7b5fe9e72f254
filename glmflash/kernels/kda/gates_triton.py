"""Triton forms of the KDA layer's elementwise gates: the forget gate with beta, and the gated
per-head RMSNorm of the output. Each replaces about ten small torch launches per layer with one;
same semantics as `kda_gates_ref` and `gated_rms_norm_ref`."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit


@jit
def kda_gates_kernel(f, dt_bias, a_log, b, g, beta, lower_bound, stride_f, stride_b,
                     H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                     HAS_LOWER_BOUND: tl.constexpr):
    """Token i_t, head i_h: g = lb * sigmoid(exp(A_log) * (f + dt_bias)) (or -exp(A_log) *
    softplus(...)), and beta = sigmoid(b) rounded to beta's dtype."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    i_t64 = i_t.to(tl.int64)
    b_f = tl.load(f + i_t64 * stride_f + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_g = log_decay(b_f, dt_bias, a_log, lower_bound, i_h, o_d, m_d, D, HAS_LOWER_BOUND)
    tl.store(g + (i_t64 * H + i_h) * D + o_d, b_g, mask=m_d)
    b_b = tl.load(b + i_t64 * stride_b + i_h).to(tl.float32)
    tl.store(beta + i_t64 * H + i_h, tl.sigmoid(b_b).to(beta.dtype.element_ty))


@jit
def log_decay(b_f, dt_bias, a_log, lower_bound, i_h, o_d, m_d, D: tl.constexpr,
              HAS_LOWER_BOUND: tl.constexpr):
    """Head i_h's log-decay from its forget-gate pre-activations `b_f` (fp32, channels o_d):
    lb * sigmoid(exp(A_log) * (f + dt_bias)), or -exp(A_log) * softplus(f + dt_bias). The gates
    kernel and the decode step both call it, so their gates are the same bits."""
    b_f += tl.load(dt_bias + i_h * D + o_d, mask=m_d, other=0.0)
    rate = tl.exp(tl.load(a_log + i_h).to(tl.float32))
    if HAS_LOWER_BOUND:
        return lower_bound * tl.sigmoid(rate * b_f)
    return -rate * tl.where(b_f > 20.0, b_f, tl.log(1.0 + tl.exp(b_f)))


@jit
def gated_rms_norm_kernel(o, gate, weight, out, eps, stride_o, stride_gate, stride_out,
                          D: tl.constexpr, BD: tl.constexpr):
    """Head i_h of token i_t: w * o * rsqrt(mean(o^2) + eps) * sigmoid(gate), in fp32."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    i_t64 = i_t.to(tl.int64)
    b_o = tl.load(o + i_t64 * stride_o + i_h * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_o = b_o * tl.rsqrt(tl.sum(b_o * b_o, 0) / D + eps)
    b_gate = tl.load(gate + i_t64 * stride_gate + i_h * D + o_d, mask=m_d,
                     other=0.0).to(tl.float32)
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_w * b_o * tl.sigmoid(b_gate)
    tl.store(out + i_t64 * stride_out + i_h * D + o_d, b_y.to(out.dtype.element_ty), mask=m_d)


def kda_gates(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
              lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `kda_gates_ref`."""
    num_tokens, heads = b.shape
    dim = f.shape[1] // heads
    assert f.stride(1) == 1 and b.stride(1) == 1 and dt_bias.is_contiguous()
    assert dt_bias.dtype == torch.float32
    g = torch.empty(num_tokens, heads, dim, dtype=torch.float32, device=f.device)
    beta = torch.empty(num_tokens, heads, dtype=b.dtype, device=b.device)
    if num_tokens:
        kda_gates_kernel[(num_tokens, heads)](
            f, dt_bias, a_log, b, g, beta, 0.0 if lower_bound is None else float(lower_bound),
            f.stride(0), b.stride(0), H=heads, D=dim, BD=triton.next_power_of_2(dim),
            HAS_LOWER_BOUND=lower_bound is not None, num_warps=1)
    return g, beta


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """Triton `gated_rms_norm_ref`: o `[T, H, d]`, gate `[T, H * d]` -> `[T, H * d]`."""
    num_tokens, heads, dim = o.shape
    assert o.stride(2) == 1 and o.stride(1) == dim and gate.stride(1) == 1
    assert weight.is_contiguous() and weight.shape == (dim,)
    out = torch.empty(num_tokens, heads * dim, dtype=o.dtype, device=o.device)
    if num_tokens:
        gated_rms_norm_kernel[(num_tokens, heads)](
            o, gate, weight, out, eps, o.stride(0), gate.stride(0), out.stride(0), D=dim,
            BD=triton.next_power_of_2(dim), num_warps=1)
    return out


__all__ = ["gated_rms_norm", "kda_gates"]
