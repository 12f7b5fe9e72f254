"""Estimates, from the model's sizes alone, of the memory a forward needs beyond weights and
cache: activations and kernel workspaces of a prefill chunk and of a batch of decodes, and what
the decode CUDA graphs keep.

A forward holds the residual streams (the layer's input and output, `[T, hc_mult, hidden]`) plus
the peak of one layer, the largest of:
- MLA: q `[T, heads, qk]` and its copy for the absorbed product, the absorbed q and the latent
  output `[T, heads, kv_lora_rank]` each, o `[T, heads, v]`, the selection `[T, W]` int64, the
  indexer's q `[T, index_heads, index_dim]` and (reference kernels) the gathered latents
  `[T, W, kv_lora_rank]` fp32;
- KDA: q, k, v before and after the short conv `[T, linear_dim]` each, fp32 gates and the chunked
  recurrence's two fp32 `[T, linear_dim]` operands;
- MoE: per routed pair the activation `[moe_intermediate]` and the expert output `[hidden]`, and
  fp32 router logits; a dense MLP's gate/up and activation;
plus the indexer's score tile (bounded by its tiling, not by the context), the rows of logits
(the sampled ones and, in a prefill, up to one per new token for prompt log-probabilities, with
their log-softmax) and, on the GPU, the partial outputs of split sparse MLA launches (bounded by
one wave of programs, not by the tokens). Each term is exact for the tensor it names; what is not
named in the layers (norm outputs, small metadata) is covered by `SLACK`. On a GPU the engine also
measures the warm-up's peak and the graphs' memory, and the ledger shows both
(engine/memory_plan.py).
"""

from __future__ import annotations

from glmflash.config import KDA, MLA, ModelConfig
from glmflash.kernels.indexer.ref import REF_TILING, SelectTiling
from glmflash.kernels.sparse_mla.plan import HEAD_BLOCK

# Unnamed small tensors (norms, router top-k, metadata): a fraction of the named ones.
SLACK = 1.25
FP32, INT64 = 4, 8
# Programs of one wave on the largest GPU planned for (2 per SM on up to 132 SMs): a split sparse
# MLA launch keeps one partial output and log-sum-exp per head of each.
SPLIT_PROGRAMS = 264


def _gpu_tiling() -> SelectTiling:
    from glmflash.kernels.indexer.triton_impl import TILING

    return TILING


def selection_width(config: ModelConfig) -> int:
    """Token slots one query attends (the indexer's selection width)."""
    return config.index_topk + (config.index_kpool - 1
                                if config.index_kpool_always_select_tail else 0)


def per_token_bytes(config: ModelConfig, item: int, reference: bool) -> int:
    """Activation bytes per new token at a forward's peak (streams plus the largest layer)."""
    streams = 2 * config.hc_mult * config.hidden_size * item
    layers = []
    if MLA in config.layer_types:
        layers.append(_mla_bytes(config, item, reference))
    if KDA in config.layer_types:
        layers.append(3 * config.linear_dim * (2 * item + 3 * FP32))
    if "sparse" in config.mlp_layer_types:
        pairs = config.num_experts_per_tok * (config.moe_intermediate_size + config.hidden_size)
        layers.append(pairs * item + config.n_routed_experts * FP32
                      + 3 * config.moe_intermediate_size * item)
    if "dense" in config.mlp_layer_types:
        layers.append(3 * config.intermediate_size * item)
    return streams + max(layers, default=0)


def _mla_bytes(config: ModelConfig, item: int, reference: bool) -> int:
    heads, width = config.num_attention_heads, selection_width(config)
    q = config.q_lora_rank + 2 * heads * config.qk_head_dim + heads * config.v_head_dim
    latent = 2 * heads * config.kv_lora_rank
    index = config.index_n_heads * config.index_head_dim + 2 * config.index_head_dim
    total = (q + latent + index) * item + width * INT64
    if reference:
        total += width * config.kv_lora_rank * FP32
    return total


def score_tile_bytes(config: ModelConfig, num_rows: int, max_pools: int,
                     reference: bool) -> int:
    """The indexer's largest score tile for `num_rows` queries over `max_pools` pools."""
    k = config.index_topk // config.index_kpool
    if reference:
        tiling = REF_TILING
        per_pool = config.index_n_heads + config.index_head_dim
    else:
        tiling = _gpu_tiling()
        per_pool = 1
    pools = min(max(tiling.pool_tile, k), max(max_pools, 1))
    rows = min(num_rows, tiling.row_tile(pools + k, per_pool))
    # The tile, a second tile (the reference's merged copy, the GPU top-k's candidate list),
    # and the best k (values and int64 ordinals).
    return rows * ((pools + k) * per_pool * FP32 * 2 + k * (FP32 + INT64))


def forward_bytes(config: ModelConfig, num_tokens: int, num_logit_rows: int, max_pools: int,
                  item: int, reference: bool) -> int:
    """Estimated peak bytes of one forward of `num_tokens` new tokens (any mix of sequences)
    whose longest context has `max_pools` pools, returning `num_logit_rows` rows of logits."""
    layers = int(num_tokens * per_token_bytes(config, item, reference) * SLACK)
    scores = score_tile_bytes(config, num_tokens, max_pools, reference)
    partials = 0 if reference else split_partial_bytes(config)
    return layers + scores + partials + logit_bytes(config, num_logit_rows, item)


def split_partial_bytes(config: ModelConfig) -> int:
    """The workspace of split sparse MLA launches (kernels/sparse_mla/plan.py)."""
    if MLA not in config.layer_types:
        return 0
    rows = SPLIT_PROGRAMS * min(config.num_attention_heads, HEAD_BLOCK)
    return rows * (config.kv_lora_rank + 1) * FP32


def logit_bytes(config: ModelConfig, num_rows: int, item: int) -> int:
    """Rows of logits: lm_head's output, its fp32 copy and a log-softmax of it."""
    return num_rows * config.vocab_size * (item + 2 * FP32)


def graph_bytes(config: ModelConfig, batch_sizes: list[int], widths: list[int],
                item: int) -> int:
    """Decode CUDA graphs: one shared pool as large as the largest graph's forward (captured
    first), plus what every graph keeps: its logits `[B, V]` fp32, hidden states `[B, D]`
    and input rows."""
    if not batch_sizes or not widths:
        return 0
    pool = forward_bytes(config, max(batch_sizes), max(batch_sizes), max(widths), item,
                         reference=False)
    per_row = config.vocab_size * FP32 + config.hidden_size * item + 16 * INT64
    kept = sum(b * per_row for b in batch_sizes) * len(widths)
    return pool + kept
