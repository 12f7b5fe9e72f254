"""The routed experts' rows before their sum, and the sum: each (token, slot) pair's expert
output in pair order, weighed by its routing weight and summed per token in slot order.
`fused_moe` sums them in a launch of their own (`sum_rows`); a consumer that reads the MoE output
once anyway (the decoder layer's hyper_post) can take the `ExpertRows` and form the same sum as
it reads (`routed_sum`, the one jit helper both use, so the same bits)."""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit

# Output columns per program of the sum.
SUM_BLOCK = 1024


class ExpertRows(NamedTuple):
    """`rows` `[T * k, D]`: pair (t, j)'s expert output at row t * k + j (rows of skipped
    pairs, ids outside [0, num_experts), unwritten); `ids` and `weights` `[T, k]`."""

    rows: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    num_experts: int

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    def summed(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The per-token sum `[T, D]` in the rows' dtype (`sum_rows`)."""
        return sum_rows(self, out)


@jit
def routed_sum(y, ids, weights, i_t, o_d, m_d, num_experts, stride_ym, TOP_K: tl.constexpr):
    """sum over slots j (in order) of weights[t, j] * y[t * TOP_K + j] in fp32, features `o_d`
    of token `i_t`; a skipped slot's row of y is never read (it was never written)."""
    b_acc = tl.zeros(o_d.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        i_p = i_t * TOP_K + j
        b_e = tl.load(ids + i_p) + o_d * 0  # the slot's expert in every lane
        m_y = m_d & (b_e >= 0) & (b_e < num_experts)
        w = tl.load(weights + i_p).to(tl.float32)
        b_y = tl.load(y + i_p.to(tl.int64) * stride_ym + o_d, mask=m_y, other=0.0)
        b_acc += tl.where(m_y, w * b_y.to(tl.float32), 0.0)
    return b_acc


@jit
def fused_moe_sum_kernel(y, ids, weights, out, num_experts, D, stride_ym, stride_om,
                         TOP_K: tl.constexpr, BD: tl.constexpr):
    """out[t] = `routed_sum` of token t, rounded to out's dtype."""
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_acc = routed_sum(y, ids, weights, i_t, o_d, m_d, num_experts, stride_ym, TOP_K)
    tl.store(out + i_t.to(tl.int64) * stride_om + o_d, b_acc.to(out.dtype.element_ty), mask=m_d)


def sum_rows(rows: ExpertRows, out: torch.Tensor | None = None) -> torch.Tensor:
    """`[T, D]`: each token's weighted sum of its rows, one launch."""
    num_tokens, top_k = rows.ids.shape
    hidden = rows.rows.shape[1]
    if out is None:
        out = torch.empty(num_tokens, hidden, dtype=rows.rows.dtype, device=rows.rows.device)
    if num_tokens == 0 or top_k == 0:
        return out.zero_()
    fused_moe_sum_kernel[(num_tokens, triton.cdiv(hidden, SUM_BLOCK))](
        rows.rows, rows.ids, rows.weights, out, rows.num_experts, hidden, rows.rows.stride(0),
        out.stride(0), TOP_K=top_k, BD=SUM_BLOCK, num_warps=4)
    return out


__all__ = ["SUM_BLOCK", "ExpertRows", "fused_moe_sum_kernel", "routed_sum", "sum_rows"]
