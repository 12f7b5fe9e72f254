"""KDA linear-attention mixer (spec/model.md §3)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.kda import causal_conv1d, kda
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.layers import Linear, fused_weight
from glmflash.model.state import ModelState


class KimiDeltaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads, d = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        width, kernel = heads * d, config.linear_conv_kernel_dim
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, heads, d
        self.lower_bound = config.linear_lower_bound
        self.norm_eps = config.rms_norm_eps
        self.q_proj = Linear(hidden, width, dtype)
        self.k_proj = Linear(hidden, width, dtype)
        self.v_proj = Linear(hidden, width, dtype)
        # NOTE: the conv weights stay fp32 (the reference keeps conv1d in fp32).
        self.q_conv1d = _conv_weight(width, kernel)
        self.k_conv1d = _conv_weight(width, kernel)
        self.v_conv1d = _conv_weight(width, kernel)
        self.f_a_proj = Linear(hidden, d, dtype)
        self.f_b_proj = Linear(d, width, dtype)
        self.dt_bias = nn.Parameter(torch.empty(width, dtype=torch.float32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.b_proj = Linear(hidden, heads, dtype)
        self.g_a_proj = Linear(hidden, d, dtype)
        self.g_b_proj = Linear(d, width, dtype)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(d, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(width, hidden, dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, state: ModelState) -> torch.Tensor:
        num_tokens = x.shape[0]
        heads, d = self.num_heads, self.head_dim
        # q, k, v in one product; the small projections of x (forget gate, beta, output gate)
        # in another.
        mixed = nn.functional.linear(x, fused_weight((self.q_proj, self.k_proj, self.v_proj)))
        small = nn.functional.linear(x, fused_weight((self.f_a_proj, self.b_proj,
                                                      self.g_a_proj)))
        f_a, b, g_a = small.split([d, heads, d], dim=-1)
        mixed = causal_conv1d(mixed, self.conv_weight(), state.conv[self.layer_idx],
                              batch.cu_seqlens, batch.state_slots, batch.is_fresh)
        q, k, v = (t.view(num_tokens, heads, d) for t in mixed.chunk(3, dim=-1))
        o = kda(q, k, v, self.forget_gate(f_a), torch.sigmoid(b), state.recurrent[self.layer_idx],
                batch.cu_seqlens, batch.state_slots, batch.is_fresh)
        gate = self.g_b_proj(g_a).view(num_tokens, heads, d)
        return self.o_proj(self.gated_norm(o, gate).reshape(num_tokens, heads * d))

    def conv_weight(self) -> torch.Tensor:
        """The q, k, v conv filters stacked `[3 * width, kernel]` (fp32), made once."""
        sources = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        if sources[0].requires_grad and torch.is_grad_enabled():
            return torch.cat(sources).squeeze(1)  # training: no cached copy (keeps the gradient)
        key = tuple(w.data_ptr() for w in sources)
        if getattr(self, "_conv_key", None) != key:
            self._conv_weight = torch.cat(sources).squeeze(1).contiguous()
            self._conv_key = key
        return self._conv_weight

    def forget_gate(self, f_a: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay `[T, H, d]` in (lower_bound, 0), fp32, from f_a_proj(x)."""
        f = self.f_b_proj(f_a).float() + self.dt_bias
        f = f.view(f_a.shape[0], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, -1, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * f)
        return -rate * nn.functional.softplus(f, threshold=20.0)

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm with the weight and sigmoid gate applied in fp32 (spec §3.6)."""
        of = o.float()
        of = of * torch.rsqrt(of.square().mean(-1, keepdim=True) + self.norm_eps)
        return (self.o_norm.weight.float() * of * torch.sigmoid(gate.float())).to(o.dtype)


def _conv_weight(channels: int, kernel: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32),
                                 requires_grad=False)
    return module
