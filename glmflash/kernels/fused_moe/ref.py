"""Routed experts of one MoE layer (spec/model.md §5.1, §5.3): the fp32 spec of `fused_moe`.

Shapes (E experts held, hidden D, expert width I, T tokens, k experts per token, b = block):
    x             [T, D]                  any float dtype, computed in fp32
    ids           [T, k]                  int, an expert at most once per token; < 0 = skip
                                          (ids may index a subset of experts, e.g. the resident
                                          ones, with the others masked to -1)
    weights       [T, k]                  routing weights (already normalised and scaled)
    w_gate, w_up  [E, I, D]               float8_e4m3fn with scales, or plain float (scales None)
    s_gate, s_up  [E, ceil(I/b), ceil(D/b)]  fp32 scale_inv: W = fp8 * s[n // b, k // b]
    w_down        [E, D, I]
    s_down        [E, ceil(D/b), ceil(I/b)]
    returns       [T, D]                  x's dtype

Per token t and chosen expert e with weight w, summed over the experts in ascending order:
    a = min(x W_gate^T, L); u = clip(x W_up^T, -L, L); y_t += w * (silu(a) * u) W_down^T.
"""

from __future__ import annotations

import torch

from glmflash.kernels.fp8_gemm.ref import dequantize_block_fp8


def expert_weight(weight: torch.Tensor, scale: torch.Tensor | None, e: int,
                  block: int) -> torch.Tensor:
    """Expert `e` of a stacked projection in fp32: `[N, K]`."""
    if scale is None:
        return weight[e].float()
    return dequantize_block_fp8(weight[e], scale[e], block=block)


def fused_moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  w_gate: torch.Tensor, s_gate: torch.Tensor | None, w_up: torch.Tensor,
                  s_up: torch.Tensor | None, w_down: torch.Tensor, s_down: torch.Tensor | None,
                  *, limit: float, block: int = 128) -> torch.Tensor:
    """Weighted sum of each token's experts' clamped-SwiGLU outputs, `[T, D]` in x's dtype."""
    num_experts, _, hidden = w_gate.shape
    assert x.ndim == 2 and x.shape[1] == hidden, f"x {tuple(x.shape)} vs hidden {hidden}"
    assert ids.shape == weights.shape and ids.shape[0] == x.shape[0]
    xf = x.float()
    out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        assert e < num_experts, f"expert id {e} out of range [0, {num_experts})"
        token_ids, slot_ids = torch.nonzero(ids == e, as_tuple=True)
        h = xf[token_ids]  # [n, D]
        gate = (h @ expert_weight(w_gate, s_gate, e, block).T).clamp(max=limit)  # [n, I]
        up = (h @ expert_weight(w_up, s_up, e, block).T).clamp(-limit, limit)  # [n, I]
        y = (torch.nn.functional.silu(gate) * up) @ expert_weight(w_down, s_down, e, block).T
        out.index_add_(0, token_ids, weights[token_ids, slot_ids].float()[:, None] * y)
    return out.to(x.dtype)
