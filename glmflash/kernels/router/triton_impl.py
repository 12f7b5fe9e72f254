"""Triton MoE routing: the sigmoid scores of few tokens (fp32 FMA over the model-dtype weight,
whose products are exact in fp32) and the choice (bias, group limit, top-k, weights). At one
token one launch: the expert block that finishes its scores last makes the choice. From two
tokens the choice is a launch of a program per token, after the scores launch (up to
`SCORE_TOKENS` tokens) or, above, one fp32 GEMM as in the reference. Ties choose the lower
expert index; the reference's top-k leaves that open."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.router.ref import RouterSpec, scores_ref
from glmflash.kernels.triton_utils import ArrivalCounters, jit

# Up to this many tokens the scores come from router_scores_kernel; above, from cuBLAS.
SCORE_TOKENS = 64
# Per-device counters of the expert blocks done per token block (every launch leaves them at
# zero; allocated once, so captured graphs stay valid).
_ARRIVALS = ArrivalCounters(1 << 8)


@dataclass(frozen=True)
class ScoreConfig:
    """Launch shape of router_scores_kernel: a program owns `block_t` tokens and `block_e`
    experts and walks the hidden size `block_k` columns a step; `select_warps`: warps of the
    choice's program per token."""

    block_t: int
    block_e: int
    block_k: int
    num_warps: int = 4
    select_warps: int = 4
    fused_select: bool = True
    """The last expert block of a token block to finish makes its tokens' choices (one launch);
    False: the choice is a second launch of a program per token (faster from two tokens)."""


def default_score_config(num_tokens: int) -> ScoreConfig:
    """Two experts a program and a [BT, BE, BK] product tile of 4K values; the choice inside the
    scores launch at one token only (README.md says why)."""
    bt = min(4, triton.next_power_of_2(max(num_tokens, 1)))
    return ScoreConfig(block_t=bt, block_e=2, block_k=max(128, min(2048, 4096 // (bt * 2))),
                       fused_select=num_tokens == 1)


@jit
def router_scores_kernel(x, w, scores, bias, ids, weights, arrivals, T, E, K, stride_x,
                         stride_w, stride_s, EG, scaling, BT: tl.constexpr, BE: tl.constexpr,
                         BK: tl.constexpr, SELECT: tl.constexpr, G: tl.constexpr,
                         GP: tl.constexpr, EGP: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                         TOPK: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr):
    """scores[t, e] = sigmoid(x[t] . w[e]) in fp32 for tokens [i_t * BT, +BT), experts
    [i_e * BE, +BE): products into a [BT, BE, BK] tile, reduced once. SELECT: the expert block
    that arrives last at `arrivals[i_t]` makes the token block's choices (`_choose`)."""
    i_e, i_t = tl.program_id(0), tl.program_id(1)
    o_t = i_t * BT + tl.arange(0, BT)
    o_e = i_e * BE + tl.arange(0, BE)
    o_k = tl.arange(0, BK)
    m_t, m_e = o_t < T, o_e < E
    p_x = x + o_t[:, None].to(tl.int64) * stride_x + o_k[None, :]
    p_w = w + o_e[:, None].to(tl.int64) * stride_w + o_k[None, :]
    b_acc = tl.zeros([BT, BE, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = k0 + o_k < K
        b_x = tl.load(p_x + k0, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(p_w + k0, mask=m_e[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_acc += b_x[:, None, :] * b_w[None, :, :]
    b_s = tl.sigmoid(tl.sum(b_acc, 2))
    p_s = scores + o_t[:, None].to(tl.int64) * stride_s + o_e[None, :]
    tl.store(p_s, b_s, mask=m_t[:, None] & m_e[None, :])
    if SELECT:
        # Every warp's scores are written before the release; the last block reads them all.
        tl.debug_barrier()
        if tl.atomic_add(arrivals + i_t, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            for j in tl.static_range(BT):
                if i_t * BT + j < T:
                    _choose(scores, bias, ids, weights, (i_t * BT + j).to(tl.int64), stride_s,
                            EG, scaling, G, GP, EGP, TOPK_GROUPS, TOPK, KP, RENORM)
            tl.atomic_xchg(arrivals + i_t, 0, sem="relaxed")


@jit
def router_select_kernel(scores, bias, ids, weights, stride_s, EG, scaling, G: tl.constexpr,
                         GP: tl.constexpr, EGP: tl.constexpr, TOPK_GROUPS: tl.constexpr,
                         TOPK: tl.constexpr, KP: tl.constexpr, RENORM: tl.constexpr):
    """Token t = program 0's choice (`_choose`)."""
    _choose(scores, bias, ids, weights, tl.program_id(0).to(tl.int64), stride_s, EG, scaling, G,
            GP, EGP, TOPK_GROUPS, TOPK, KP, RENORM)


@jit
def _choose(scores, bias, ids, weights, i_t, stride_s, EG, scaling, G: tl.constexpr,
            GP: tl.constexpr, EGP: tl.constexpr, TOPK_GROUPS: tl.constexpr, TOPK: tl.constexpr,
            KP: tl.constexpr, RENORM: tl.constexpr):
    """Token i_t: choice = scores + bias over a [groups, experts per group] tile; keep the
    TOPK_GROUPS groups whose two best choices sum highest; the TOPK best kept experts; their
    scores (renormalised) times `scaling`. The scores are read past L1 (other programs may
    have just written them)."""
    o_g = tl.arange(0, GP)
    o_j = tl.arange(0, EGP)
    m = (o_g < G)[:, None] & (o_j < EG)[None, :]
    expert = o_g[:, None] * EG + o_j[None, :]
    b_s = tl.load(scores + i_t * stride_s + expert, mask=m, other=0.0,
                  cache_modifier=".cg")  # [GP, EGP]
    b_c = b_s + tl.load(bias + expert, mask=m, other=0.0)
    # A NaN score ranks below every number but above the padding and the experts taken (-inf),
    # so a token's k choices stay distinct real experts; its weights carry the NaN on. The
    # stand-in is half the float range, so that the sum of a group's two best stays finite.
    b_c = tl.where(m, tl.where(b_c == b_c, b_c, -1.0e38), float("-inf"))
    if G > 1:
        b_first = tl.argmax(b_c, 1)  # [GP]
        b_second = tl.max(tl.where(o_j[None, :] == b_first[:, None], float("-inf"), b_c), 1)
        b_group = tl.where(o_g < G, tl.max(b_c, 1) + b_second, float("-inf"))
        m_keep = o_g < 0  # [GP]
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.argmax(b_group, 0)
            m_keep = m_keep | (o_g == best)
            b_group = tl.where(o_g == best, float("-inf"), b_group)
        b_c = tl.where(m_keep[:, None], b_c, float("-inf"))
    o_f = tl.arange(0, GP * EGP)
    f_c = tl.reshape(b_c, [GP * EGP])
    f_s = tl.reshape(b_s, [GP * EGP])
    f_e = tl.reshape(expert, [GP * EGP])
    o_k = tl.arange(0, KP)
    b_ids = tl.zeros([KP], dtype=tl.int64)
    b_w = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(TOPK):
        best = tl.argmax(f_c, 0)
        m_hit = o_f == best  # [GP * EGP]
        b_ids = tl.where(o_k == i, tl.sum(tl.where(m_hit, f_e, 0), 0).to(tl.int64), b_ids)
        b_w = tl.where(o_k == i, tl.sum(tl.where(m_hit, f_s, 0.0), 0), b_w)
        f_c = tl.where(m_hit, float("-inf"), f_c)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 0) + 1e-20)
    tl.store(ids + i_t * TOPK + o_k, b_ids, mask=o_k < TOPK)
    tl.store(weights + i_t * TOPK + o_k, b_w * scaling, mask=o_k < TOPK)


def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, *, spec: RouterSpec,
          weight_fp32: torch.Tensor | None = None, score_config: ScoreConfig | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `route_ref`: x `[T, D]`, weight `[E, D]` (model dtype), bias `[E]` fp32. One
    launch at one token (`ScoreConfig.fused_select`), two above; no host
    sync."""
    num_tokens, dim = x.shape
    num_experts = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1 and bias.is_contiguous()
    assert num_experts % spec.num_groups == 0
    ids = torch.empty(num_tokens, spec.top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(num_tokens, spec.top_k, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return ids, weights
    cfg = score_config or default_score_config(num_tokens)
    per_group = num_experts // spec.num_groups
    choice = dict(G=spec.num_groups, GP=triton.next_power_of_2(spec.num_groups),
                  EGP=triton.next_power_of_2(per_group), TOPK_GROUPS=spec.topk_groups,
                  TOPK=spec.top_k, KP=triton.next_power_of_2(spec.top_k),
                  RENORM=spec.renormalize)
    if num_tokens <= SCORE_TOKENS:
        scores = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        token_blocks = triton.cdiv(num_tokens, cfg.block_t)
        arrivals = _ARRIVALS.get(x.device, token_blocks) if cfg.fused_select else None
        router_scores_kernel[(triton.cdiv(num_experts, cfg.block_e), token_blocks)](
            x, weight, scores, bias, ids, weights, scores if arrivals is None else arrivals,
            num_tokens, num_experts, dim, x.stride(0), weight.stride(0), scores.stride(0),
            per_group, float(spec.scaling), BT=cfg.block_t, BE=cfg.block_e, BK=cfg.block_k,
            SELECT=arrivals is not None, **choice, num_warps=cfg.num_warps)
        if arrivals is not None:
            return ids, weights
    else:
        scores = scores_ref(x, weight, weight_fp32)
    router_select_kernel[(num_tokens,)](
        scores, bias, ids, weights, scores.stride(0), per_group, float(spec.scaling), **choice,
        num_warps=cfg.select_warps)
    return ids, weights
