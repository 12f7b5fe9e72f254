"""Routed experts of one MoE layer on block-FP8 weights (spec/model.md §5.1, §5.3): the fp32 spec.

Shapes (E experts, hidden D, expert width I, T tokens, k experts per token, b = block):
    x             [T, D]             any float dtype, computed in fp32
    topk_ids      [T, k]             int, each expert at most once per token; < 0 = skip
    topk_weights  [T, k]             routing weights (already normalised and scaled)
    gate_w, up_w  [E, I, D]          float8_e4m3fn
    gate_s, up_s  [E, ceil(I/b), ceil(D/b)]  fp32 scale_inv: W = fp8 * s[n // b, k // b]
    down_w        [E, D, I]          float8_e4m3fn
    down_s        [E, ceil(D/b), ceil(I/b)]  fp32
    returns       [T, D]             fp32

Per token t and chosen expert e with weight w:
    a = min(x W_gate^T, L); b = clip(x W_up^T, -L, L); y_t += w * (silu(a) * b) W_down^T.
"""

from __future__ import annotations

import torch

from glmflash.kernels.fp8_gemm.ref import dequantize_block_fp8


def swiglu_clamp_ref(a: torch.Tensor, b: torch.Tensor, swiglu_limit: float) -> torch.Tensor:
    """`silu(min(a, L)) * clip(b, -L, L)`: the clamp acts on the pre-activations."""
    a = a.clamp(max=swiglu_limit)
    b = b.clamp(min=-swiglu_limit, max=swiglu_limit)
    return torch.nn.functional.silu(a) * b


def routed_experts_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                       gate_w: torch.Tensor, gate_s: torch.Tensor, up_w: torch.Tensor,
                       up_s: torch.Tensor, down_w: torch.Tensor, down_s: torch.Tensor, *,
                       swiglu_limit: float, block: int = 128) -> torch.Tensor:
    """Weighted sum of the chosen experts' SwiGLU-with-clamp outputs, `[T, D]` fp32."""
    num_experts, inter, hidden = gate_w.shape
    assert x.ndim == 2 and x.shape[1] == hidden, f"x {tuple(x.shape)} vs hidden {hidden}"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0]
    assert up_w.shape == gate_w.shape and down_w.shape == (num_experts, hidden, inter)
    x = x.float()
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        token_ids, slot_ids = torch.nonzero(topk_ids == e, as_tuple=True)
        w_gate = dequantize_block_fp8(gate_w[e], gate_s[e], block=block)  # [I, D]
        w_up = dequantize_block_fp8(up_w[e], up_s[e], block=block)  # [I, D]
        w_down = dequantize_block_fp8(down_w[e], down_s[e], block=block)  # [D, I]
        xe = x[token_ids]  # [n, D]
        h = swiglu_clamp_ref(xe @ w_gate.T, xe @ w_up.T, swiglu_limit)  # [n, I]
        weight = topk_weights[token_ids, slot_ids].float()[:, None]  # [n, 1]
        out.index_add_(0, token_ids, weight * (h @ w_down.T))
    return out
