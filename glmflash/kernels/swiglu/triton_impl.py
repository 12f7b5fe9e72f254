"""Triton clamped SwiGLU over a stacked [gate | up] product: one launch where the reference takes
four (two clamps, the silu and the product)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.triton_utils import jit

# Features per program: small rows (decode) still spread over several programs.
BLOCK = 1024


@jit
def clamp_gate_up(b_g, b_u, limit):
    """min(g, L) and clip(u, -L, L) as torch's clamps give them: a NaN stays NaN (Triton's
    min / max return the other operand by default, which would turn a NaN into a limit)."""
    b_g = tl.minimum(b_g, limit, propagate_nan=tl.PropagateNan.ALL)
    b_u = tl.maximum(b_u, -limit, propagate_nan=tl.PropagateNan.ALL)
    return b_g, tl.minimum(b_u, limit, propagate_nan=tl.PropagateNan.ALL)


@jit
def swiglu_values(g, u, limit):
    """silu(min(g, L)) * clip(u, -L, L) in g's dtype, the silu rounded to it before the product
    (torch rounds each op's result). Also the FP8 linear's input when it takes the stacked
    product (fp8_gemm/triton_impl.py), so both give the same bits."""
    dt = g.dtype
    b_g, b_u = clamp_gate_up(g.to(tl.float32), u.to(tl.float32), limit)
    act = (b_g / (1.0 + tl.exp(-b_g))).to(dt).to(tl.float32)
    return (act * b_u).to(dt)


@jit
def swiglu_kernel(gate_up, out, width, stride_in, stride_out, limit, BLOCK: tl.constexpr):
    """Row `i`, features [j * BLOCK, +BLOCK): out = `swiglu_values` of the row's gate and up
    halves (out has gate_up's dtype)."""
    i, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o = j * BLOCK + tl.arange(0, BLOCK)
    m = o < width
    p_row = gate_up + i * stride_in
    g = tl.load(p_row + o, mask=m, other=0.0)
    u = tl.load(p_row + width + o, mask=m, other=0.0)
    tl.store(out + i * stride_out + o, swiglu_values(g, u, limit), mask=m)


def clamped_swiglu_stacked(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """`clamped_swiglu_ref(gate, up)` of `gate_up` `[..., 2W]` (gate then up) -> `[..., W]`."""
    assert gate_up.shape[-1] % 2 == 0
    lead, width = gate_up.shape[:-1], gate_up.shape[-1] // 2
    gate_up = gate_up.reshape(-1, 2 * width)
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    rows = gate_up.shape[0]
    out = torch.empty(*lead, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        swiglu_kernel[(rows, triton.cdiv(width, block))](
            gate_up, out, width, gate_up.stride(0), width, limit, BLOCK=block,
            num_warps=4)
    return out
