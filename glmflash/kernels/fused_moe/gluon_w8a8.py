"""The W8A8 prefill form on SM90 through the warp-specialised Gluon GEMM (fp8_gemm/gluon_sm90.py):
the same numerics as triton_w8a8.py, the products at the FP8 tensor-core rate.

Launches after the sort (128-row blocks) and the activation quantiser:
1. `gather_rows_kernel`: the quantised token rows copied into the sorted layout (TMA reads
   contiguous tiles, so the gate/up GEMM cannot gather), their scales K-block-major;
2. the gated grouped GEMM: gate and up, the clamped SwiGLU, h quantised per 128 columns;
3. the grouped down projection, each row stored into its pair's row of y.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm import gluon_sm90
from glmflash.kernels.triton_utils import interpreting, jit

BLOCK_M = gluon_sm90.BLOCK_M


@dataclass(frozen=True)
class GluonMoeConfig:
    """The W8A8 form on the Gluon GEMM: its launch shape; the sort's blocks are its rows."""

    gemm: gluon_sm90.GluonGemmConfig = gluon_sm90.GLUON_CONFIG

    @property
    def block_m(self) -> int:
        """Rows per sort block: one GEMM tile, so TMA reads whole tiles of one expert."""
        return BLOCK_M


GLUON_W8A8_CONFIG = GluonMoeConfig()
GATHER_ROWS, GATHER_COLS = 16, 512  # GATHER_ROWS divides BLOCK_M: a program's rows share a block


@jit
def gather_rows_kernel(xq, xs, sorted_pairs, block_expert, aq, a_s, num_pairs, K, KB, stride_xm,
                       stride_xsm, stride_am, stride_ask, TOP_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr,
                       BKB: tl.constexpr):
    """aq[r] = xq[token of sorted row r] and its scales into a_s[:, r]; padding rows get zero
    codes and zero scales (their products are zero and they are never stored). Rows of unused
    blocks are left alone: their sorted_pairs entries were never written."""
    if tl.load(block_expert + tl.program_id(0) * BR // BLOCK_M) < 0:
        return
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    b_pair = tl.load(sorted_pairs + o_r)
    m_r = b_pair < num_pairs
    o_t = tl.where(m_r, b_pair // TOP_K, 0).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < K
    b_x = tl.load(xq + o_t[:, None] * stride_xm + o_c[None, :], mask=m_r[:, None] & m_c[None, :],
                  other=0.0)
    tl.store(aq + o_r[:, None].to(tl.int64) * stride_am + o_c[None, :], b_x, mask=m_c[None, :])
    if tl.program_id(1) == 0:
        o_kb = tl.arange(0, BKB)
        m_kb = o_kb < KB
        b_s = tl.load(xs + o_t[:, None] * stride_xsm + o_kb[None, :],
                      mask=m_r[:, None] & m_kb[None, :], other=0.0)
        tl.store(a_s + o_kb[None, :] * stride_ask + o_r[:, None], b_s, mask=m_kb[None, :])


def gather_rows(xq: torch.Tensor, xs: torch.Tensor, sorted_pairs: torch.Tensor,
                block_expert: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted layout's rows (BLOCK_M-row blocks; rows of unused blocks unwritten): (e4m3
    `[R, K]`, scales `[R, K/128]` M-major)."""
    num_tokens, k = xq.shape
    rows = sorted_pairs.numel()
    kb = xs.shape[1]
    aq = torch.empty(rows, k, dtype=xq.dtype, device=xq.device)
    a_s = torch.empty(kb, rows, dtype=torch.float32, device=xq.device)
    gather_rows_kernel[(triton.cdiv(rows, GATHER_ROWS), triton.cdiv(k, GATHER_COLS))](
        xq, xs, sorted_pairs, block_expert, aq, a_s, num_tokens * top_k, k, kb, xq.stride(0),
        xs.stride(0), aq.stride(0), a_s.stride(0), TOP_K=top_k, BLOCK_M=BLOCK_M, BR=GATHER_ROWS,
        BC=GATHER_COLS, BKB=triton.next_power_of_2(kb), num_warps=4)
    return aq, a_s.t()


def gluon_fits(x: torch.Tensor, hidden: int, inter: int, block: int) -> bool:
    """Whether the Gluon form serves experts of `hidden` x `inter` for x: an SM90 GPU, 16-bit x,
    128 x 128 weight scales and both widths whole scale blocks."""
    return (gluon_sm90.available(x.device) and not interpreting() and block == BLOCK_M
            and x.dtype in (torch.bfloat16, torch.float16) and hidden % block == 0
            and inter % block == 0)


def gluon_experts(xq: torch.Tensor, xs: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_expert: torch.Tensor, top_k: int, w_gate: torch.Tensor,
                  s_gate: torch.Tensor, w_up: torch.Tensor, s_up: torch.Tensor,
                  w_down: torch.Tensor, s_down: torch.Tensor, *, limit: float,
                  out_dtype: torch.dtype, config: GluonMoeConfig = GLUON_W8A8_CONFIG
                  ) -> torch.Tensor:
    """`w8a8_experts` on the Gluon GEMM: quantised tokens `xq` `[T, D]` with scales `[T, D/128]`
    over a sort into 128-row blocks -> each pair's expert output `[T * top_k, D]`."""
    assert sorted_pairs.numel() == BLOCK_M * block_expert.numel()
    aq, a_s = gather_rows(xq, xs, sorted_pairs, block_expert, top_k)
    hq, hs = gluon_sm90.grouped_gate_up(aq, a_s, block_expert, w_gate, s_gate, w_up, s_up,
                                        limit=limit, config=config.gemm)
    return gluon_sm90.grouped_down(hq, hs, block_expert, sorted_pairs, w_down, s_down,
                                   xq.shape[0] * top_k, out_dtype, config=config.gemm)


__all__ = ["GLUON_W8A8_CONFIG", "GluonMoeConfig", "gather_rows", "gather_rows_kernel",
           "gluon_experts", "gluon_fits"]
