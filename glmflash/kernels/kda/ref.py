"""Kimi Delta Attention: short causal conv and the gated delta rule (spec/model.md §3).

Packed varlen layout: tokens of B sequences concatenated, `cu_seqlens` (host list, B+1 entries)
delimits them. Per-sequence state lives in slots (`state_slots[b]`) of the state tensors and is
updated in place; `is_fresh[b]` means the sequence starts here (zero history).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class GateParams(NamedTuple):
    """The forget gate's parameters, for a decode step that forms the gates itself from their
    pre-activations (`kda_gates_ref`): then `g` holds f `[T, H * dk]` and `beta` holds b
    `[T, H]`, and the step computes the log-decay and sigmoid(b) as `kda_gates` does."""

    dt_bias: torch.Tensor
    a_log: torch.Tensor
    lower_bound: float | None


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                      cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool]
                      ) -> torch.Tensor:
    """Depthwise causal conv + SiLU in fp32, cast to x's dtype.

    x `[T, C]`, weight `[C, K]`, conv_state `[S, C, K-1]` (the last K-1 inputs per slot).
    """
    num_tokens, channels = x.shape
    hist_len = weight.shape[-1] - 1
    device = x.device
    num_seqs = len(state_slots)
    slots = torch.tensor(state_slots, dtype=torch.long, device=device)
    fresh = torch.tensor(is_fresh, dtype=torch.bool, device=device)
    hist = conv_state[slots].transpose(1, 2).masked_fill(fresh[:, None, None], 0)  # [B, K-1, C]
    # One buffer holding [history_b | tokens_b] per sequence, so every window is a gather.
    lens = torch.tensor(cu_seqlens, device=device).diff()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lens)
    token_pos = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * hist_len
    starts = torch.tensor(cu_seqlens[:-1], device=device) + torch.arange(num_seqs,
                                                                       device=device) * hist_len
    hist_pos = (starts[:, None] + torch.arange(hist_len, device=device)).flatten()
    ext = torch.empty(num_tokens + num_seqs * hist_len, channels, dtype=x.dtype, device=device)
    ext[token_pos] = x
    ext[hist_pos] = hist.reshape(-1, channels).to(x.dtype)
    window = token_pos[:, None] + torch.arange(-hist_len, 1, device=device)  # [T, K]
    out = (ext[window].float() * weight.float().t()).sum(1)  # [T, C]
    last = starts + lens + hist_len - 1  # ext row of each sequence's newest input
    keep = last[:, None] + torch.arange(-hist_len + 1, 1, device=device)  # [B, K-1]
    conv_state[slots] = ext[keep].transpose(1, 2).to(conv_state.dtype)
    return F.silu(out).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum x^2 + eps)` (eps inside the root, as the reference)."""
    return x / torch.sqrt(x.square().sum(-1, keepdim=True) + eps)


def kda_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, cu_seqlens: list[int], state_slots: list[int],
            is_fresh: list[bool], *, chunk_size: int = 64) -> torch.Tensor:
    """Gated delta rule with per-channel decay. Returns o `[T, H, dv]` in q's dtype.

    q, k `[T, H, dk]`, v `[T, H, dv]`, g `[T, H, dk]` log-decay (fp32), beta `[T, H]`,
    state `[S, H, dk, dv]` fp32, updated in place. Single-token sequences take the recurrent
    form, longer ones the chunked form (the reference's split).
    """
    out_dtype = q.dtype
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = l2_normalize(k.float()), v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    lens = [cu_seqlens[b + 1] - cu_seqlens[b] for b in range(len(state_slots))]
    decode = [b for b, n in enumerate(lens) if n == 1]
    if decode:
        tok = torch.tensor([cu_seqlens[b] for b in decode], device=q.device)
        slots = torch.tensor([state_slots[b] for b in decode], device=q.device)
        fresh = torch.tensor([is_fresh[b] for b in decode], device=q.device)
        s0 = state[slots].masked_fill(fresh[:, None, None, None], 0)
        out[tok], state[slots] = recurrent_step(s0, q[tok], k[tok], v[tok], g[tok], beta[tok])
    for b, n in enumerate(lens):
        if n <= 1:
            continue
        s0 = torch.zeros_like(state[0]) if is_fresh[b] else state[state_slots[b]]
        sl = slice(cu_seqlens[b], cu_seqlens[b + 1])
        out[sl], state[state_slots[b]] = chunked_sequence(
            q[sl], k[sl], v[sl], g[sl], beta[sl], s0, chunk_size)
    return out.to(out_dtype)


def recurrent_step(s: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch: s `[B, H, dk, dv]`; decay, read, correct, write, output."""
    s = s * g.exp().unsqueeze(-1)
    read = torch.einsum("bhkv,bhk->bhv", s, k)
    delta = beta.unsqueeze(-1) * (v - read)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return torch.einsum("bhkv,bhk->bhv", s, q), s


def chunked_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, s0: torch.Tensor, chunk_size: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence `[n, H, d]` in chunks; derivation in kernels/kda/README.md."""
    n = q.shape[0]
    pad = -n % chunk_size
    q, k, v, g = (F.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for t in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad)).transpose(0, 1)  # [H, n+pad]
    outs, s = [], s0
    for c0 in range(0, n + pad, chunk_size):
        c = slice(c0, c0 + chunk_size)
        o, s = _chunk(q[:, c], k[:, c], v[:, c], g[:, c], beta[:, c], s)
        outs.append(o)
    return torch.cat(outs, dim=1)[:, :n].transpose(0, 1), s


def _chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           s0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk for all heads.

    Shapes: q, k, g `[H, C, dk]`, v `[H, C, dv]`, beta `[H, C]`, s0 `[H, dk, dv]`.
    """
    size = q.shape[1]
    cum = g.cumsum(dim=1)
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay[h, t, s, c] = exp(cum_t - cum_s) for s <= t; masked before exp so it never overflows.
    diff = cum.unsqueeze(2) - cum.unsqueeze(1)
    diff = diff.masked_fill(~causal[None, :, :, None], float("-inf"))
    decay = diff.exp()
    kk, qk = _decayed_products(q, k, decay)
    kk = kk.tril(-1)
    rhs = beta.unsqueeze(-1) * (v - (k * cum.exp()) @ s0)
    system = torch.eye(size, device=q.device) + beta.unsqueeze(-1) * kk
    delta = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    out = (q * cum.exp()) @ s0 + qk @ delta
    last = cum[:, -1:]
    s_new = last.transpose(1, 2).exp() * s0 + (k * (last - cum).exp()).transpose(1, 2) @ delta
    return out, s_new


def _decayed_products(q: torch.Tensor, k: torch.Tensor, decay: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`[H, C, C]` sums over the key dimension of k_t k_s decay and q_t k_s decay. (A function of
    its own so that the tiny-model trainer can swap in a form that is fast under autograd on a
    GPU: tools/tiny_train_ops.py.)"""
    return (torch.einsum("htc,hsc,htsc->hts", k, k, decay),
            torch.einsum("htc,hsc,htsc->hts", q, k, decay))


def kda_gates_ref(f: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, b: torch.Tensor,
                  lower_bound: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forget gate's log-decay `[T, H, d]` fp32 and beta `[T, H]` (b's dtype) from the
    projections f `[T, H * d]` and b `[T, H]` (spec/model.md §3.3): with a lower bound,
    `lb * sigmoid(exp(A_log) * (f + dt_bias))`, else `-exp(A_log) * softplus(f + dt_bias)`."""
    heads = a_log.shape[0]
    f = (f.float() + dt_bias).view(f.shape[0], heads, -1)
    rate = a_log.float().exp().view(1, -1, 1)
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(rate * f)
    else:
        g = -rate * F.softplus(f, threshold=20.0)
    return g, torch.sigmoid(b)


def gated_rms_norm_ref(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Per-head RMSNorm of o `[T, H, d]` with the weight `[d]` and the sigmoid of gate
    `[T, H * d]` applied in fp32 (spec §3.6); `[T, H * d]` in o's dtype."""
    of = o.float()
    of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + eps)
    gate = gate.float().view(o.shape)
    return (weight.float() * of * torch.sigmoid(gate)).to(o.dtype).reshape(o.shape[0], -1)
