"""KDA linear-attention mixer (spec/model.md §3)."""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import ModelConfig
from glmflash.kernels.kda import (
    GateParams,
    causal_conv1d,
    causal_conv1d_decode,
    gated_rms_norm,
    kda,
    kda_decode,
    kda_gates,
)
from glmflash.model.forward_batch import ForwardBatch
from glmflash.model.layers import Linear, fused_weight, stacked_parameters
from glmflash.model.state import ModelState
from glmflash.model.verify import verify_conv, verify_kda
from glmflash.utils.derived import kept


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
        # q, k, v in one product; the small projections of x (forget gate, output gate, beta)
        # in another; the two gates' up-projections in a third (`_gate_projections`).
        qkv_weight, small_weight, up_weight = self.stack_weights()
        mixed = nn.functional.linear(x, qkv_weight)
        small = nn.functional.linear(x, small_weight)
        f, out_gate = self._gate_projections(small[:, : 2 * d], up_weight)
        b = small[:, 2 * d:]
        conv_state, recurrent = state.conv[self.layer_idx], state.recurrent[self.layer_idx]
        if batch.verify is not None:
            mixed = verify_conv(mixed, self.conv_weight(), conv_state, batch.verify,
                                self.layer_idx)
        elif batch.decode is not None:
            mixed = causal_conv1d_decode(mixed, self.conv_weight(), conv_state,
                                         batch.decode.conv_meta)
        else:
            mixed = causal_conv1d(mixed, self.conv_weight(), conv_state, batch.cu_seqlens,
                                  batch.state_slots, batch.is_fresh)
        q, k, v = (t.view(num_tokens, heads, d) for t in mixed.chunk(3, dim=-1))
        # Decode and verify steps form the gates from f and b themselves (one launch fewer).
        gates = GateParams(self.dt_bias, self.A_log, self.lower_bound)
        if batch.verify is not None:
            o = verify_kda(q, k, v, f, b, recurrent, batch.verify, self.layer_idx, gates)
        elif batch.decode is not None:
            o = kda_decode(q, k, v, f, b, recurrent, batch.decode.kda_meta, gates=gates)
        else:
            g, beta = kda_gates(f, self.dt_bias, self.A_log, b, self.lower_bound)
            o = kda(q, k, v, g, beta, recurrent, batch.cu_seqlens, batch.state_slots,
                    batch.is_fresh)
        return self.o_proj(gated_rms_norm(o, out_gate, self.o_norm.weight, self.norm_eps))

    def _gate_projections(self, low_rank: torch.Tensor, up_weight: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The forget gate's and the output gate's up-projections of their low-rank halves of
        `low_rank` `[T, 2d]` (f_a then g_a), as one batched product over their stacked weights
        `up_weight` `[2 * H * d, d]`: (f `[T, H * d]`, output gate `[T, H * d]`)."""
        width, d = self.f_b_proj.weight.shape
        halves = low_rank.unflatten(-1, (2, d)).transpose(0, 1)  # [2, T, d], a view
        up = torch.bmm(halves, up_weight.view(2, width, d).transpose(1, 2))
        return up[0], up[1]

    def stack_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked weights of the layer's joined products (built once): q, k, v; the small
        projections of x (forget gate, output gate, beta); the two gates' up-projections."""
        return (fused_weight((self.q_proj, self.k_proj, self.v_proj)),
                fused_weight((self.f_a_proj, self.g_a_proj, self.b_proj)),
                stacked_parameters((self.f_b_proj.weight, self.g_b_proj.weight)))

    def conv_weight(self) -> torch.Tensor:
        """The q, k, v conv filters stacked `[3 * width, kernel]` (fp32), made once."""
        sources = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        if sources[0].requires_grad and torch.is_grad_enabled():
            return torch.cat(sources).squeeze(1)  # training: no cached copy (keeps the gradient)
        return kept(self, "conv_weight", tuple(w.data_ptr() for w in sources),
                    lambda: torch.cat(sources).squeeze(1).contiguous())


def _conv_weight(channels: int, kernel: int) -> nn.Module:
    module = nn.Module()
    module.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=torch.float32),
                                 requires_grad=False)
    return module
