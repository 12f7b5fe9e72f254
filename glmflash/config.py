"""Model configuration parsed once from a checkpoint's config.json (spec/model.md §1)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from glmflash.utils.validation import is_integer, is_number, require

SUPPORTED_MODEL_TYPES = ("glm5_next", "glm5_next_text")
KDA = "linear_attention"
MLA = "indexed_attention"
# Spellings the reference's config machinery renames on load.
_LAYER_TYPE_ALIASES = {
    "deepseek_sparse_attention": MLA,
    "full_attention": MLA,
    "mamba": KDA,
}


class ConfigError(ValueError):
    """A config.json that glmflash cannot run."""


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    out_hidden_size: int = 1536
    projection_intermediate_size: int = 10240
    attention_bias: bool = True
    rms_norm_eps: float = 1e-5
    swiglu_limit: float = 10.0
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> VisionConfig:
        kwargs = _known_fields(cls, _object(raw, "vision_config"), "vision_config.")
        rope = _object(raw.get("rope_parameters") or {}, "vision_config.rope_parameters")
        if rope.get("rope_type", "axial") != "axial":
            raise ConfigError(
                f"vision rope_type {rope['rope_type']!r} is not supported (only 'axial')"
            )
        if "rope_theta" in rope:
            kwargs["rope_theta"] = float(rope["rope_theta"])
        return cls(**kwargs)


@dataclass(frozen=True)
class QuantConfig:
    """FP8 e4m3 weights with fp32 `weight_scale_inv` per block (spec/model.md §7.4)."""

    quant_method: str = "fp8"
    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    activation_scheme: str = "dynamic"

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> QuantConfig:
        raw = _object(raw, "quantization_config")
        method = raw.get("quant_method")
        if method != "fp8":
            raise ConfigError(
                f"quantization_config.quant_method {method!r} is not supported (only 'fp8')"
            )
        if raw.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(
                f"quantization_config.fmt {raw['fmt']!r} is not supported (only 'e4m3')"
            )
        block = raw.get("weight_block_size") or (128, 128)
        # The kernels take square blocks (one size for both weight dimensions).
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(is_integer(b) and b > 0 for b in block) and block[0] == block[1]):
            raise ConfigError(f"quantization_config.weight_block_size {block!r} must be two "
                              f"equal positive integers (square blocks)")
        scheme = raw.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigError(f"quantization_config.activation_scheme {scheme!r} is not "
                              f"supported (only 'dynamic')")
        return cls(weight_block_size=tuple(block), activation_scheme=scheme)


@dataclass(frozen=True)
class ModelConfig:
    """Text config of glm5_next plus the multimodal token ids, vision and quantisation parts."""

    vocab_size: int = 154880
    hidden_size: int = 4096
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 45
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    attention_bias: bool = False
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 16
    index_kpool_always_select_tail: bool = True
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    swiglu_limit: float = 10.0
    hidden_act: str = "silu"
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float | None = -5.0
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    pad_token_id: int | None = 154820
    eos_token_id: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    mlp_layer_types: tuple[str, ...] = ()
    image_token_id: int = 154854
    video_token_id: int = 154855
    image_start_token_id: int = 154830
    image_end_token_id: int = 154831
    video_start_token_id: int = 154832
    video_end_token_id: int = 154833
    vision: VisionConfig | None = None
    quant: QuantConfig | None = None
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_dim(self) -> int:
        """Channels of each of the KDA q, k and v projections."""
        return self.linear_num_heads * self.linear_head_dim

    @property
    def mla_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == MLA]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == KDA]

    @property
    def is_fp8(self) -> bool:
        return self.quant is not None

    @classmethod
    def from_hf(cls, path: str | Path) -> ModelConfig:
        """Parse `config.json` in a checkpoint folder (or the file itself)."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.exists():
            raise ConfigError(f"no config.json at {file}")
        try:
            raw = json.loads(file.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file}: invalid JSON ({exc})") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{file}: expected a JSON object, got {type(raw).__name__}")
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{file}: {exc}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; glmflash runs {SUPPORTED_MODEL_TYPES}"
            )
        text = raw.get("text_config")
        # A config without text_config is a flat text config (reference backward compatibility).
        text = dict(raw if text is None else _object(text, "text_config"))
        kwargs = _known_fields(cls, text, "text_config." if "text_config" in raw else "")
        kwargs.update(_linear_attn_fields(text))
        kwargs.update(_layer_schedules(text))
        kwargs["eos_token_id"] = _as_tuple(text.get("eos_token_id", raw.get("eos_token_id")))
        for key in ("image_token_id", "video_token_id", "image_start_token_id",
                    "image_end_token_id", "video_start_token_id", "video_end_token_id"):
            if key in raw:
                kwargs[key] = int(raw[key])
        if raw.get("vision_config") is not None:
            kwargs["vision"] = VisionConfig.from_dict(raw["vision_config"])
        quant = raw.get("quantization_config") or text.get("quantization_config")
        if quant is not None:
            kwargs["quant"] = QuantConfig.from_dict(quant)
        return cls(**kwargs)


# What a field's annotation ("int", "float | None", ...) lets a config.json value be.
_VALUE_CHECKS = {"int": (is_integer, "an integer"),
                 "float": (is_number, "a number"),
                 "bool": (lambda v: isinstance(v, bool), "true or false"),
                 "str": (lambda v: isinstance(v, str), "a string")}
_PARSED_APART = {"vision", "quant", "eos_token_id", "layer_types", "indexer_types",
                 "mlp_layer_types"}


def _known_fields(cls: type, raw: dict[str, Any], where: str = "") -> dict[str, Any]:
    """The dataclass's fields found in `raw`, each checked against its annotation (ConfigError
    naming the key where a value has another type: it would fail far from the config)."""
    if "num_local_experts" in raw and "n_routed_experts" not in raw:
        raw = {**raw, "n_routed_experts": raw["num_local_experts"]}
    out = {}
    for field in fields(cls):
        if field.name in _PARSED_APART or field.name not in raw:
            continue
        value = raw[field.name]
        kind, _, optional = str(field.type).partition(" | ")
        check, what = _VALUE_CHECKS.get(kind, (lambda v: True, ""))
        if not (value is None and optional == "None") and not check(value):
            raise ConfigError(f"{where}{field.name} must be {what}, got {value!r}")
        out[field.name] = value
    return out


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _linear_attn_fields(text: dict[str, Any]) -> dict[str, Any]:
    """`linear_attn_config` overrides the four linear_* fields, as the reference does."""
    lin = text.get("linear_attn_config")
    if lin is None:
        return {}
    out: dict[str, Any] = {}
    for src, dst in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                     ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                     ("gate_lower_bound", "linear_lower_bound")):
        if src in lin:
            out[dst] = lin[src]
    lower = out.get("linear_lower_bound", text.get("linear_lower_bound", -5.0))
    if lin.get("safe_gate", True) and lower is None:
        out["linear_lower_bound"] = -5.0
    return out


def _layer_schedules(text: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Derive layer_types, indexer_types and mlp_layer_types exactly as the reference post-init."""
    n = int(text.get("num_hidden_layers", 45))
    mlp = text.get("mlp_layer_types")
    if mlp is None:
        mlp = ["dense"] * min(3, n) + ["sparse"] * (n - 3)
    layers = text.get("layer_types")
    if layers is None:
        layers = [KDA if i % 4 != 3 else MLA for i in range(n)]
    layers = [_LAYER_TYPE_ALIASES.get(t, t) for t in layers]
    indexers = text.get("indexer_types")
    if indexers is None:
        pattern = text.get("index_topk_pattern")
        if pattern is not None:
            indexers = ([{"F": "full", "S": "shared"}[c] for c in pattern]
                        if isinstance(pattern, str) else list(pattern))
        else:
            freq = max(int(text.get("index_topk_freq", 1)), 1)
            offset = int(text.get("index_skip_topk_offset", 2))
            indexers = [
                "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)
            ]
    return {"layer_types": tuple(layers), "indexer_types": tuple(indexers),
            "mlp_layer_types": tuple(mlp)}


def _validate(cfg: ModelConfig) -> None:
    n = cfg.num_hidden_layers
    for name in ("layer_types", "indexer_types", "mlp_layer_types"):
        if len(getattr(cfg, name)) != n:
            raise ConfigError(f"{name} has {len(getattr(cfg, name))} entries, expected {n}")
    _check_values("layer_types", cfg.layer_types, (KDA, MLA))
    _check_values("indexer_types", cfg.indexer_types, ("full", "shared"))
    _check_values("mlp_layer_types", cfg.mlp_layer_types, ("dense", "sparse"))
    checks = [
        (cfg.num_attention_heads == cfg.num_key_value_heads,
         "num_attention_heads must equal num_key_value_heads"),
        (cfg.qk_rope_head_dim == 0, "qk_rope_head_dim must be 0 (the MLA layers are NoPE)"),
        (cfg.q_lora_rank is not None and cfg.q_lora_rank > 0, "q_lora_rank is required"),
        (cfg.index_kpool >= 1, "index_kpool must be positive"),
        (cfg.index_topk % cfg.index_kpool == 0, "index_topk must be divisible by index_kpool"),
        (cfg.n_routed_experts % cfg.n_group == 0, "n_routed_experts must be divisible by n_group"),
        (cfg.n_routed_experts // cfg.n_group >= 2, "each expert group needs at least 2 experts"),
        (cfg.topk_group <= cfg.n_group, "topk_group must not exceed n_group"),
        (cfg.num_experts_per_tok <= cfg.topk_group * cfg.n_routed_experts // cfg.n_group,
         "num_experts_per_tok exceeds the experts of the kept groups"),
        (cfg.hidden_act == "silu", f"hidden_act {cfg.hidden_act!r} is not supported (only silu)"),
        (MLA in cfg.layer_types, "at least one indexed_attention (MLA) layer is required"),
        (cfg.vision is None or cfg.vision.out_hidden_size == cfg.hidden_size,
         "vision_config.out_hidden_size must equal hidden_size"),
    ]
    require(checks, ConfigError)
    for i, kind in enumerate(cfg.indexer_types):
        shared_ok = i > 0 and cfg.layer_types[i - 1] == MLA and cfg.indexer_types[i - 1] == "full"
        if cfg.layer_types[i] == MLA and kind == "shared" and not shared_ok:
            raise ConfigError(f"layer {i}: a shared indexer must directly follow a full MLA layer")


def _check_values(name: str, values: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    bad = sorted({v for v in values if v not in allowed})
    if bad:
        raise ConfigError(f"{name} has unsupported values {bad}; allowed {list(allowed)}")
