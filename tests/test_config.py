"""ModelConfig.from_hf: real and tiny configs, derived schedules as the reference derives them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from glmflash.config import KDA, MLA, ConfigError, ModelConfig


def _write(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return ModelConfig.from_hf(tmp_path)


def _release_config() -> dict:
    """The released config.json as reconstructed in spec/model.md (oracle_recipe/real_config.py)."""
    return json.loads((Path(__file__).parent / "data" / "release_config.json").read_text())


def test_release_config(tmp_path):
    cfg = _write(tmp_path, _release_config())
    assert cfg.mla_layers == list(range(3, 45, 4))
    assert len(cfg.kda_layers) == 34
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 42
    assert cfg.indexer_types == ("full",) * 45
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_lower_bound) == (64, 128, -5.0)
    assert cfg.index_kpool == 4 and cfg.qk_head_dim == 256 and cfg.linear_dim == 8192
    assert cfg.quant.weight_block_size == (128, 128)
    assert cfg.vision.out_hidden_size == 4096
    assert cfg.eos_token_id == (154820, 154827, 154829)


def test_flat_text_config_and_defaults(tmp_path):
    cfg = _write(tmp_path, {"model_type": "glm5_next", "num_hidden_layers": 8})
    assert cfg.layer_types == tuple(MLA if i % 4 == 3 else KDA for i in range(8))
    assert cfg.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 5
    assert cfg.index_kpool == 16  # the HF default, not the release value
    assert cfg.vision is None and cfg.quant is None


@pytest.mark.parametrize("kwargs,expected", [
    ({"index_topk_pattern": "FFFFFFFS"}, "FFFFFFFS"),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 3}, "FFFSSSFS"),
    ({}, "FFFFFFFF"),
])
def test_indexer_types_derivation_matches_reference(tmp_path, kwargs, expected):
    from transformers import Glm5NextConfig

    text = {"num_hidden_layers": 8, **kwargs}
    ref = Glm5NextConfig(text_config=dict(text)).text_config.indexer_types
    assert "".join("F" if t == "full" else "S" for t in ref) == expected
    if "S" in expected:  # the default 3:1 layout puts a KDA layer before every MLA layer
        with pytest.raises(ConfigError, match="shared indexer must directly follow"):
            _write(tmp_path, {"model_type": "glm5_next", "text_config": text})
        return
    cfg = _write(tmp_path, {"model_type": "glm5_next", "text_config": text})
    assert list(cfg.indexer_types) == ref


@pytest.mark.parametrize("patch,message", [
    ({"model_type": "llama"}, "model_type 'llama' is not supported"),
    ({"text_config": {"num_attention_heads": 4, "num_key_value_heads": 2}}, "must equal"),
    ({"text_config": {"qk_rope_head_dim": 64}}, "NoPE"),
    ({"text_config": {"index_topk": 10, "index_kpool": 4}}, "divisible"),
    ({"text_config": {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3}},
     "layer_types has 3 entries"),
    ({"text_config": {"num_hidden_layers": 3, "layer_types": ["linear_attention"] * 3}},
     "at least one indexed_attention"),
    ({"text_config": {"num_hidden_layers": 2, "layer_types": ["mamba2", "full_attention"]}},
     "unsupported values"),
    ({"quantization_config": {"quant_method": "awq"}}, "not supported"),
    ({"vision_config": {"out_hidden_size": 7}}, "out_hidden_size must equal"),
    # Values of the wrong type are named where they are, not where they would fail.
    ({"text_config": {"num_hidden_layers": "6"}}, "text_config.num_hidden_layers must be an "
     "integer, got '6'"),
    ({"text_config": {"hidden_size": None}}, "hidden_size must be an integer, got None"),
    ({"text_config": {"n_routed_experts": True}}, "n_routed_experts must be an integer"),
    ({"text_config": {"rms_norm_eps": "1e-5"}}, "rms_norm_eps must be a number"),
    ({"vision_config": {"depth": 2.5}}, "vision_config.depth must be an integer"),
    ({"text_config": [1]}, "text_config must be an object, got list"),
    ({"quantization_config": ["fp8"]}, "quantization_config must be an object"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}},
     "square blocks"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": 128}},
     "square blocks"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128.0, 128.0]}},
     "square blocks"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
     "activation_scheme 'static' is not supported"),
])
def test_bad_configs_are_rejected(tmp_path, patch, message):
    config = {"model_type": "glm5_next", "text_config": {"num_hidden_layers": 4}}
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    with pytest.raises(ConfigError, match=message):
        _write(tmp_path, config)


def test_legacy_layer_type_spellings(tmp_path):
    cfg = _write(tmp_path, {"model_type": "glm5_next", "text_config": {
        "num_hidden_layers": 2, "layer_types": ["mamba", "deepseek_sparse_attention"]}})
    assert cfg.layer_types == (KDA, MLA)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ConfigError, match="invalid JSON"):
        ModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object, got list"):
        ModelConfig.from_hf(tmp_path)


def test_shared_indexer_after_full_mla_layer(tmp_path):
    cfg = _write(tmp_path, {"model_type": "glm5_next", "text_config": {
        "num_hidden_layers": 3, "index_topk_pattern": "FFS",
        "layer_types": ["linear_attention", "full_attention", "full_attention"]}})
    assert cfg.indexer_types == ("full", "full", "shared")
