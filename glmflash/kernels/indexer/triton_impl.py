"""Triton DSA indexer selection: pooled-key scores, top-k pools, expansion to token slots.

`indexer_select` = a scoring kernel (per query: relu per head, weighted sum over heads, over the
query's candidate pools only) + the radix top-k of topk_triton.py over each query's candidates
+ an expansion kernel (pool ordinals -> slots of their tokens, then the query's incomplete
pool). Pools and tokens are found through the page table; the per-query plan (row, position,
complete pools) comes from `ref.select_plan` or `ref.decode_select_plan`. Each query's number of
candidates stays on the device, so a CUDA graph captured at a wide `max_pools` pays only for
the pools that exist. Ties may choose and order differently from the reference. Pooled keys
come in either format of key_format.py (the model dtype, or FP8 rows: `FP8_KEYS`).
`indexer_write` stays the reference (a few rows per sequence).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmflash.kernels.indexer import key_format
from glmflash.kernels.indexer.ref import SelectPlan, SelectTiling, indexer_write_ref
from glmflash.kernels.indexer.topk_triton import DEFAULT_CONFIG, TopkConfig, topk_indices

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None

from glmflash.kernels.fp8_gemm.triton_common import has_fp8_products, quantize_rows
from glmflash.kernels.triton_utils import (
    constexpr,
    dot_operand_type,
    interpreting,
    jit,
    num_sms,
    product_precision,
)

# How the query rows enter the scoring products (`_query_rows`): in their own dtype; as fp16
# scaled by a power of two (FP8 keys beside 16-bit queries); as e4m3 codes with a scale per row
# (FP8 keys, `fp8_queries`).
Q_AS_IS = constexpr(0)
Q_POW2 = constexpr(1)
Q_FP8 = constexpr(2)

# fp32 scores held at once (512 MiB): rows of queries are scored together over every pool of
# their longest sequence, as many rows as fit; the workspace is bounded whatever the context.
TILING = SelectTiling(max_score_elems=1 << 27, pool_tile=1 << 62)


@dataclass(frozen=True)
class ScoreLaunch:
    """Launch shape of the scoring: one query and one pool block per program
    (`indexer_score_kernel`), or several of either (`indexer_score_tiled_kernel`)."""

    queries: int = 4
    """Consecutive queries per program (a power of two). One query and one pool block: the
    one-query kernel (`indexer_score_kernel`)."""
    pool_blocks: int = 1
    """Blocks of `block_pools` pools each program scores in turn, its queries loaded once."""
    num_stages: int = 1
    """Software pipeline depth of that loop (gathers of the next blocks in flight)."""
    block_pools: int = 64
    """Pools per block: the N of each product (a power of two, at least 16)."""
    num_warps: int = 4
    """Warps a program."""
    def grid(self, num_queries: int, max_pools: int) -> tuple[int, int]:
        """Programs along the queries and along the pools for `num_queries` rows scoring up
        to `max_pools` pools each."""
        blocks = -(-max_pools // self.block_pools)
        return -(-num_queries // self.queries), -(-blocks // self.pool_blocks)

    def __post_init__(self) -> None:
        if self.queries < 1 or self.queries & (self.queries - 1):
            raise ValueError(f"queries {self.queries}: a power of two")
        if self.pool_blocks < 1:
            raise ValueError(f"pool_blocks {self.pool_blocks}: at least 1")
        if self.block_pools < 16 or self.block_pools & (self.block_pools - 1):
            raise ValueError(f"block_pools {self.block_pools}: a power of two >= 16")


# Prefill chunks: 4 queries and 16 pool blocks per program, two stages (README.md has the
# launch sweep).
CHUNK_SCORE = ScoreLaunch(queries=4, pool_blocks=16, num_stages=2)
ONE_QUERY = ScoreLaunch(queries=1)


@dataclass(frozen=True)
class DecodeScoreRule:
    """The scoring of batches of decodes (no chunk of `CHUNK_SCORE.queries` queries of one
    sequence): the first of `tiled` whose grid still gives every SM `min_programs_per_sm`
    programs (long contexts, many sequences: a program's query is loaded once for its pool
    blocks, whose gathers are pipelined), else one query and one pool block per program
    (short work needs every program it can get). README.md has the measurements."""

    tiled: tuple[ScoreLaunch, ...] = (
        ScoreLaunch(queries=1, pool_blocks=8, num_stages=3, block_pools=128),)
    min_programs_per_sm: int = 1

    def pick(self, queries: int, max_pools: int, sms: int) -> ScoreLaunch:
        for launch in self.tiled:
            along_queries, along_pools = launch.grid(queries, max_pools)
            if along_queries * along_pools >= self.min_programs_per_sm * sms:
                return launch
        return ONE_QUERY


DECODE_SCORE = DecodeScoreRule()


@jit
def _slot_of(page_table, row, pos, stride_pt, PAGE: tl.constexpr, mask):
    """Cache slot of token position `pos` of the sequence in page-table `row` (int64)."""
    page = tl.load(page_table + row * stride_pt + pos // PAGE, mask=mask, other=0).to(tl.int64)
    return page * PAGE + pos % PAGE


@jit
def _candidates(num_pools, positions, i_t, KPOOL: tl.constexpr):
    """Query i_t's candidate pools: complete ones ending at or before its position."""
    pos = tl.load(positions + i_t)
    return tl.minimum(tl.load(num_pools + i_t), (pos + 1) // KPOOL).to(tl.int32)


@jit
def _load_keys(pool_keys, pools, m_p, o_d, m_d, stride_pk, D, FP8_KEYS: tl.constexpr,
               DOT: tl.constexpr):
    """Pooled keys `pools` `[BP]` as product operands `[BP, BD]`, and (FP8 rows, key_format.py)
    their scales `[BP]`, which the caller applies after the sum over heads; zeros where `m_p`
    is off."""
    p_row = pool_keys + pools.to(tl.int64) * stride_pk  # [BP]
    m_k = m_p[:, None] & m_d[None, :]
    if FP8_KEYS:
        # Byte loads of 16-byte aligned rows (vectorised), reinterpreted as e4m3.
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_k, other=0)
        b_k = b_k.to(tl.float8e4nv, bitcast=True)
        b_ks = tl.load((p_row + D).to(tl.pointer_type(tl.float32)), mask=m_p, other=0.0)
    else:
        b_k = tl.load(p_row[:, None] + o_d[None, :], mask=m_k, other=0.0)
        b_ks = tl.zeros_like(m_p.to(tl.float32))
    return b_k.to(DOT), b_ks


@jit
def _query_rows(b_q, DOT: tl.constexpr, Q_FORM: tl.constexpr):
    """Query rows `[R, BD]` (fp32) as product operands, and the factor `[R]` each row's
    products take afterwards (Q_FORM: Q_AS_IS, Q_POW2 or Q_FP8).
    Q_POW2 (fp16 products beside FP8 keys, whose codes convert to fp16 in one instruction per
    two and to bf16 in several): each row is scaled by the power of two that brings its largest
    element into [2^14, 2^15), so fp16 holds its bf16 values exactly (8 significant bits within
    11, nothing past 65504; only elements below 2^-31 of the row's largest can round), and the
    factor undoes it exactly.
    Q_FP8 (e4m3 products beside FP8 keys): each row quantised as the FP8 keys are (scale = its
    largest magnitude / 448, codes rounded to nearest), the factor its scale; the keys' codes
    then enter the product as they are loaded."""
    b_amax = tl.max(tl.abs(b_q), 1)
    if Q_FORM == Q_POW2:
        b_e = ((b_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        b_e = tl.minimum(tl.maximum(b_e, -100), 127)
        b_up = ((127 + 14 - b_e) << 23).to(tl.float32, bitcast=True)
        b_down = ((127 - 14 + b_e) << 23).to(tl.float32, bitcast=True)
        return (b_q * b_up[:, None]).to(DOT), b_down
    elif Q_FORM == Q_FP8:
        b_c, b_s = quantize_rows(b_q, tl.float8e4nv, b_amax)
        return b_c.to(DOT), b_s
    else:
        return b_q.to(DOT), tl.full([b_q.shape[0]], 1.0, tl.float32)


@jit
def _product(b_q, b_k, BQ: tl.constexpr, BHQ: tl.constexpr, BP: tl.constexpr,
             PREC: tl.constexpr):
    """The product of key rows `b_k` `[BP, d]` and query rows `b_q` `[BQ * BHQ, d]`:
    `[BP, BQ * BHQ]`, the keys the first operand. On SM90 a product whose
    first operand sits in registers runs on the warpgroup tensor cores (FP8 keys are converted
    there), and the sum over heads stays within a thread's row (README.md, "Keys first")."""
    acc = tl.zeros([BP, BQ * BHQ], dtype=tl.float32)
    return tl.dot(b_k, tl.trans(b_q), acc, input_precision=PREC)


@jit
def _head_sums(b_st, b_qf, b_w, scale, BQ: tl.constexpr, BHQ: tl.constexpr, BP: tl.constexpr,
               Q_FORM: tl.constexpr):
    """`[BQ, BP]`: sum_h w relu(q_h . k * scale) for each of BQ queries and BP keys, from their
    products `b_st` `[BP, BQ * BHQ]` (`_product`), the query rows' factors `b_qf`
    (`_query_rows`) and weights `b_w` `[BQ * BHQ]`."""
    b_st = b_st * (b_qf * scale)[None, :] if Q_FORM != Q_AS_IS else b_st * scale
    b_st = tl.maximum(b_st, 0.0) * b_w[None, :]
    return tl.trans(tl.sum(tl.reshape(b_st, [BP, BQ, BHQ]), 2))


@jit
def _score_query(q, weights, pool_keys, page_table, rows, num_pools, positions, scores, i_t,
                 t_begin, i_p, scale, w_scale, stride_qt, stride_qh, stride_wt, stride_pk,
                 stride_pt, stride_st, NH, D, KPOOL: tl.constexpr, PAGE: tl.constexpr,
                 BHQ: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr, DOT: tl.constexpr,
                 PREC: tl.constexpr, FP8_KEYS: tl.constexpr, Q_FORM: tl.constexpr):
    """Scores of query i_t over its candidate pools of block i_p (none past its candidates)."""
    length = _candidates(num_pools, positions, i_t, KPOOL)
    if i_p * BP < length:
        row = tl.load(rows + i_t)
        o_p = i_p * BP + tl.arange(0, BP)
        is_cand = o_p < length
        o_h = tl.arange(0, BHQ)
        o_d = tl.arange(0, BD)
        m_h, m_d = o_h < NH, o_d < D
        i_t64 = i_t.to(tl.int64)
        b_q = tl.load(q + i_t64 * stride_qt + o_h[:, None] * stride_qh + o_d[None, :],
                      mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_q, b_qf = _query_rows(b_q, DOT, Q_FORM)  # [BHQ, BD], [BHQ]
        b_w = tl.load(weights + i_t64 * stride_wt + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_w = b_w * w_scale
        slot = _slot_of(page_table, row, o_p.to(tl.int64) * KPOOL, stride_pt, PAGE, is_cand)
        b_k, b_ks = _load_keys(pool_keys, slot // KPOOL, is_cand, o_d, m_d, stride_pk, D,
                               FP8_KEYS, DOT)  # [BP, BD], [BP]
        b_st = _product(b_q, b_k, 1, BHQ, BP, PREC)
        b_s = tl.reshape(_head_sums(b_st, b_qf, b_w, scale, 1, BHQ, BP, Q_FORM),
                         [BP])
        if FP8_KEYS:
            b_s = b_s * b_ks
        p_s = scores + (i_t - t_begin).to(tl.int64) * stride_st + o_p
        tl.store(p_s, b_s, mask=is_cand)


@jit(do_not_specialize=("t_begin", "stride_st"))
def indexer_score_kernel(q, weights, pool_keys, page_table, rows, positions, num_pools, scores,
                         lengths, t_begin, scale, w_scale, stride_qt, stride_qh, stride_wt,
                         stride_pk, stride_pt, stride_st, NH, D, KPOOL: tl.constexpr,
                         PAGE: tl.constexpr, BHQ: tl.constexpr, BD: tl.constexpr,
                         BP: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr,
                         FP8_KEYS: tl.constexpr, Q_FORM: tl.constexpr):
    """scores[t, p] = sum_h w[t, h] w_scale relu(q[t, h] . K_p * scale) for t's candidate pools
    p < lengths[t] (complete and ending at or before t's position); nothing is written past a
    row's candidates (the top-k reads only them)."""
    i_t = tl.program_id(0) + t_begin
    i_p = tl.program_id(1)
    if i_p == 0:
        tl.store(lengths + i_t - t_begin, _candidates(num_pools, positions, i_t, KPOOL))
    _score_query(q, weights, pool_keys, page_table, rows, num_pools, positions, scores, i_t,
                 t_begin, i_p, scale, w_scale, stride_qt, stride_qh, stride_wt, stride_pk,
                 stride_pt, stride_st, NH, D, KPOOL, PAGE, BHQ, BD, BP, DOT, PREC, FP8_KEYS,
                 Q_FORM)


@jit(do_not_specialize=("t_begin", "stride_st"))
def indexer_score_tiled_kernel(q, weights, pool_keys, page_table, rows, positions, num_pools,
                               scores, lengths, t_begin, num_tokens, scale, w_scale, stride_qt,
                               stride_qh, stride_wt, stride_pk, stride_pt, stride_st, NH, D,
                               KPOOL: tl.constexpr, PAGE: tl.constexpr, BQ: tl.constexpr,
                               BHQ: tl.constexpr, BD: tl.constexpr, BP: tl.constexpr,
                               POOL_BLOCKS: tl.constexpr, NUM_STAGES: tl.constexpr,
                               DOT: tl.constexpr, PREC: tl.constexpr, FP8_KEYS: tl.constexpr,
                               Q_FORM: tl.constexpr):
    """`indexer_score_kernel` for BQ consecutive queries and POOL_BLOCKS blocks of BP pools per
    program: the queries' heads are the M of one product (BQ x BHQ rows), so a block of pooled
    keys is loaded once for them all, and the queries once for all the blocks. The keys are the
    first query's sequence's; a query of another sequence (a tile across a sequence boundary)
    is scored alone, as `indexer_score_kernel` scores it."""
    i_q = tl.program_id(0)
    i_pb = tl.program_id(1)
    t_first = t_begin + i_q * BQ
    o_t = t_first + tl.arange(0, BQ)
    m_t = o_t < t_begin + num_tokens
    # Past the last query (a partial tile) the loads repeat the last query, which is in the tile.
    o_tc = tl.minimum(o_t, t_begin + num_tokens - 1)
    length = tl.where(m_t, _candidates(num_pools, positions, o_tc, KPOOL), 0)
    if i_pb == 0:
        tl.store(lengths + o_t - t_begin, length, mask=m_t)
    row0 = tl.load(rows + t_first)
    shared = tl.max(tl.where(tl.load(rows + o_tc) != row0, 1, 0), 0) == 0
    longest = tl.max(length, 0)
    p_begin = i_pb * (POOL_BLOCKS * BP)
    p_end = tl.minimum(p_begin + POOL_BLOCKS * BP, longest)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    if shared:
        if p_begin < longest:
            # Rows r = (query r // BHQ, head r % BHQ) of one product over each key block.
            o_r = tl.arange(0, BQ * BHQ)
            o_rt = (t_first + o_r // BHQ).to(tl.int64)
            o_rh = o_r % BHQ
            m_r = (o_rt < t_begin + num_tokens) & (o_rh < NH)
            p_q = q + o_rt[:, None] * stride_qt + o_rh[:, None] * stride_qh
            b_q = tl.load(p_q + o_d[None, :], mask=m_r[:, None] & m_d[None, :],
                          other=0.0).to(tl.float32)
            b_q, b_qf = _query_rows(b_q, DOT, Q_FORM)
            b_w = tl.load(weights + o_rt * stride_wt + o_rh, mask=m_r, other=0.0).to(tl.float32)
            b_w = b_w * w_scale
            p_s = scores + (o_t - t_begin).to(tl.int64)[:, None] * stride_st
            for p0 in tl.range(p_begin, p_end, BP, num_stages=NUM_STAGES):
                o_p = p0 + tl.arange(0, BP)
                is_key = o_p < longest
                slot = _slot_of(page_table, row0, o_p.to(tl.int64) * KPOOL, stride_pt, PAGE,
                                is_key)
                b_k, b_ks = _load_keys(pool_keys, slot // KPOOL, is_key, o_d, m_d, stride_pk,
                                       D, FP8_KEYS, DOT)
                b_st = _product(b_q, b_k, BQ, BHQ, BP, PREC)
                b_s = _head_sums(b_st, b_qf, b_w, scale, BQ, BHQ, BP, Q_FORM)  # [BQ, BP]
                if FP8_KEYS:
                    b_s = b_s * b_ks[None, :]
                tl.store(p_s + o_p[None, :], b_s,
                         mask=m_t[:, None] & (o_p[None, :] < length[:, None]))
    else:
        for p0 in range(p_begin, p_end, BP):
            for j in range(BQ):
                i_t = t_first + j
                if i_t < t_begin + num_tokens:
                    _score_query(q, weights, pool_keys, page_table, rows, num_pools, positions,
                                 scores, i_t, t_begin, p0 // BP, scale, w_scale, stride_qt,
                                 stride_qh, stride_wt, stride_pk, stride_pt, stride_st, NH, D,
                                 KPOOL, PAGE, BHQ, BD, BP, DOT, PREC, FP8_KEYS, Q_FORM)


@jit(do_not_specialize=("t_begin", "num_sel", "stride_pot"))
def indexer_expand_kernel(pools, page_table, rows, positions, out, t_begin, num_sel, width,
                          stride_pt, stride_pot, stride_ot, KPOOL: tl.constexpr,
                          PAGE: tl.constexpr, SELECT_TAIL: tl.constexpr, BW: tl.constexpr):
    """Row t of the selection: the slots of each chosen pool's KPOOL tokens, then the tail
    (the query's own incomplete pool), then -1, as the reference lays it out."""
    i_t = tl.program_id(0) + t_begin
    row = tl.load(rows + i_t)
    pos = tl.load(positions + i_t)
    o_c = tl.arange(0, BW)
    i_t64 = (i_t - t_begin).to(tl.int64)
    sel = o_c // KPOOL
    pool = tl.load(pools + i_t64 * stride_pot + sel, mask=sel < num_sel, other=-1)
    tok = tl.where(pool >= 0, pool * KPOOL + o_c % KPOOL, -1)
    if SELECT_TAIL:
        visible = pos + 1
        r = o_c - num_sel * KPOOL
        tail = visible - visible % KPOOL + r
        in_tail = (r >= 0) & (r < KPOOL - 1)
        tok = tl.where(in_tail, tl.where(tail < visible, tail, -1), tok)
    valid = tok >= 0
    slot = _slot_of(page_table, row, tl.where(valid, tok, 0).to(tl.int64), stride_pt, PAGE, valid)
    tl.store(out + (i_t.to(tl.int64)) * stride_ot + o_c, tl.where(valid, slot, -1),
             mask=o_c < width)


def indexer_select(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                   page_table: torch.Tensor, plan: SelectPlan, *, page_size: int, topk: int,
                   kpool: int, select_tail: bool,
                   topk_config: TopkConfig = DEFAULT_CONFIG,
                   tiling: SelectTiling | None = None,
                   score: ScoreLaunch = CHUNK_SCORE,
                   decode: DecodeScoreRule = DECODE_SCORE,
                   weight_scale: float = 1.0, fp8_queries: bool = False) -> torch.Tensor:
    """Triton `indexer_select_ref`: token slots `[T, topk + kpool - 1]` (or `[T, topk]`), -1
    padded. q `[T, H, D]`, weights `[T, H]` (any float dtype; the head weights are
    `weights.float() * weight_scale`), pool_keys `[N / kpool, D]`.
    `score`: the scoring launch when the plan has a chunk of at least `score.queries` queries
    of one sequence; they then read each block of pooled keys once for all of them
    (`indexer_score_tiled_kernel`). Otherwise (batches of decodes) `decode` picks the launch.
    `fp8_queries`: see `score_pools`."""
    num_tokens, heads, dim = q.shape
    width = topk + (kpool - 1 if select_tail else 0)
    out = torch.empty(num_tokens, width, dtype=torch.long, device=q.device)
    if num_tokens == 0:
        return out
    assert q.stride(2) == 1 and weights.stride(1) == 1 and pool_keys.stride(1) == 1
    assert key_format.key_dim(pool_keys) == dim
    assert page_table.stride(1) == 1 and plan.rows.numel() == num_tokens
    max_pools = plan.max_pools
    num_sel = min(topk // kpool, max_pools)
    per_token = (plan.rows, plan.positions)
    longest_chunk = max((g.idx.numel() for g in plan.groups if g.shared), default=1)
    rows = max(1, (tiling or TILING).max_score_elems // max(max_pools, 1))
    for t0 in range(0, num_tokens, rows):
        n = min(rows, num_tokens - t0)
        launch = score if longest_chunk >= score.queries else \
            decode.pick(n, max_pools, num_sms(q.device))
        pools = torch.empty(n, 0, dtype=torch.int32, device=q.device)
        if num_sel:
            scores = torch.empty(n, max_pools, dtype=torch.float32, device=q.device)
            lengths = torch.empty(n, dtype=torch.int32, device=q.device)
            score_pools(q, weights, pool_keys, page_table, plan, scores, lengths, t0, n,
                        page_size, kpool, launch, weight_scale=weight_scale,
                        fp8_queries=fp8_queries)
            pools = topk_indices(scores, lengths, num_sel, config=topk_config)
        indexer_expand_kernel[(n,)](
            pools, page_table, *per_token, out, t0, num_sel, width, page_table.stride(0),
            max(pools.stride(0), 1), out.stride(0), KPOOL=kpool, PAGE=page_size,
            SELECT_TAIL=select_tail, BW=triton.next_power_of_2(width), num_warps=4)
    return out


def _query_form(q: torch.Tensor, fp8_keys: bool, fp8_queries: bool):
    """(Q_FORM, the products' operand type) of a scoring launch."""
    if fp8_queries:
        if not fp8_keys:
            raise ValueError("fp8_queries: the pooled keys must be FP8 too")
        # e4m3 products where the GPU has them; the interpreter multiplies the codes in fp32,
        # older GPUs in fp16 (both hold every e4m3 value exactly).
        if interpreting():
            return Q_FP8, tl.float32
        return Q_FP8, tl.float8e4nv if has_fp8_products(q.device) else tl.float16
    if fp8_keys and q.dtype in (torch.bfloat16, torch.float16):
        return Q_POW2, tl.float16  # also in the interpreter
    return Q_AS_IS, dot_operand_type(q.dtype)


def score_pools(q, weights, pool_keys, page_table, plan: SelectPlan, scores, lengths, t0: int,
                n: int, page_size: int, kpool: int, launch: ScoreLaunch = ONE_QUERY, *,
                weight_scale: float = 1.0, fp8_queries: bool = False) -> None:
    """Scores of query rows [t0, t0 + n) over their candidate pools into `scores` `[n, >=
    max_pools]` (nothing past a row's candidates), their counts into `lengths` `[n]`: one
    program per (query, pool block), or per (`launch.queries` queries, `launch.pool_blocks`
    pool blocks). `fp8_queries` (FP8 keys only): the query rows quantised to e4m3 per head
    (`_query_rows`), as `ref.indexer_select_ref` does with the same flag."""
    heads, dim = q.shape[1], q.shape[2]
    strides = (q.stride(0), q.stride(1), weights.stride(0), pool_keys.stride(0),
               page_table.stride(0), scores.stride(0), heads, dim)
    fp8 = key_format.is_fp8(pool_keys)
    q_form, dot = _query_form(q, fp8, fp8_queries)
    shapes = dict(KPOOL=kpool, PAGE=page_size, BHQ=max(16, triton.next_power_of_2(heads)),
                  BD=max(16, triton.next_power_of_2(dim)), BP=launch.block_pools,
                  DOT=dot, PREC=product_precision(q.dtype), FP8_KEYS=fp8, Q_FORM=q_form,
                  num_warps=launch.num_warps)
    per_query = (q, weights, pool_keys, page_table, plan.rows, plan.positions, plan.num_pools,
                 scores, lengths, t0)
    grid = launch.grid(n, plan.max_pools)
    if launch.queries == 1 and launch.pool_blocks == 1:
        indexer_score_kernel[grid](*per_query, dim ** -0.5, float(weight_scale), *strides,
                                   **shapes)
    else:
        indexer_score_tiled_kernel[grid](
            *per_query, n, dim ** -0.5, float(weight_scale), *strides, BQ=launch.queries,
            POOL_BLOCKS=launch.pool_blocks, NUM_STAGES=launch.num_stages, **shapes)


indexer_write = indexer_write_ref

__all__ = ["CHUNK_SCORE", "DECODE_SCORE", "ONE_QUERY", "DecodeScoreRule", "ScoreLaunch",
           "indexer_select", "indexer_write"]
