"""config.json contents of the tiny checkpoints: the real architecture at toy sizes.

`EMBEDDED` is the default model of `glmflash generate/serve`; the test variants change the pool
size, the indexer sharing and the layer mix (spec/model.md §9.2).
"""

from __future__ import annotations

import copy
from typing import Any

DSA = "deepseek_sparse_attention"  # the release file's spelling of indexed attention
KDA = "linear_attention"
NUM_ADDED_TOKENS = 36
BASE_VOCAB = 1024


def added_token_id(offset: int) -> int:
    """Id of the added token at `offset` in the GLM order (0 = <|endoftext|>, 34 = <|image|>)."""
    return BASE_VOCAB + offset


_TEXT: dict[str, Any] = dict(
    model_type="glm5_next_text",
    vocab_size=BASE_VOCAB + 64, hidden_size=192, intermediate_size=320, moe_intermediate_size=96,
    num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
    layer_types=[KDA, DSA, DSA, KDA, KDA, DSA],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=0, v_head_dim=32,
    index_n_heads=16, index_head_dim=32, index_topk=16, index_kpool=4,
    index_kpool_always_select_tail=True,
    linear_attn_config=dict(num_heads=2, head_dim=32, short_conv_kernel_size=4,
                            gate_lower_bound=-5.0),
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, swiglu_limit=1.0,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, rms_norm_eps=1e-5, hidden_act="silu",
    max_position_embeddings=1048576, attention_bias=False, tie_word_embeddings=False,
    pad_token_id=added_token_id(0),
    eos_token_id=[added_token_id(0), added_token_id(7), added_token_id(9)],
)
_VISION: dict[str, Any] = dict(
    model_type="glm5_next_vision", depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
    patch_size=14, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=192,
    projection_intermediate_size=96, in_channels=3, swiglu_limit=1.0, rms_norm_eps=1e-5,
    attention_bias=True, hidden_act="silu", image_size=448,
)
_QUANT: dict[str, Any] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                              weight_block_size=[128, 128])

VARIANTS: dict[str, dict[str, Any]] = {
    "embedded": {},
    # 16-token pools, every indexer full, MLA layers back to back and first.
    "kpool16": dict(index_kpool=16, index_topk=32, layer_types=[DSA, DSA, KDA, KDA, DSA],
                    num_hidden_layers=5, indexer_types=["full"] * 5,
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"]),
    # The trained default (tools/train_tiny.py, trained on a GPU): narrower and shallower than
    # the embedded random model so that it ships in a few MB, with every feature kept (KDA and
    # DSA layers, a really sparse indexer, mHC, dense and MoE layers, the MTP layer, the vision
    # tower).
    "trained": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                    num_hidden_layers=4, layer_types=[KDA, DSA, KDA, DSA],
                    indexer_types=["full"] * 4, mlp_layer_types=["dense", "sparse", "sparse",
                                                                  "sparse"],
                    num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64,
                    kv_lora_rank=64, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4,
                    index_head_dim=16, index_topk=32, num_nextn_predict_layers=1,
                    linear_attn_config=dict(num_heads=4, head_dim=32, short_conv_kernel_size=4,
                                            gate_lower_bound=-5.0)),
    # The oracle recipe's own sizes (spec §9.2): narrow layers, one partial FP8 block each.
    "recipe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, q_lora_rank=32,
                   kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, index_head_dim=16,
                   index_topk=8, linear_attn_config=dict(num_heads=2, head_dim=16,
                                                         short_conv_kernel_size=4,
                                                         gate_lower_bound=-5.0)),
}


def tiny_config(variant: str = "embedded", *, fp8: bool = True) -> dict[str, Any]:
    """The full config.json dict of a tiny checkpoint variant."""
    text = copy.deepcopy(_TEXT)
    text.update(copy.deepcopy(VARIANTS[variant]))
    vision = dict(_VISION, out_hidden_size=text["hidden_size"])
    config: dict[str, Any] = dict(
        model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"],
        text_config=text, vision_config=vision, tie_word_embeddings=False,
        image_token_id=added_token_id(34), video_token_id=added_token_id(35),
        image_start_token_id=added_token_id(10), image_end_token_id=added_token_id(11),
        video_start_token_id=added_token_id(12), video_end_token_id=added_token_id(13),
    )
    if fp8:
        config["quantization_config"] = dict(_QUANT)
    return config
