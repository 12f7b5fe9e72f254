"""Make a tiny random checkpoint in the release's on-disk layout (FP8 + 128x128 block scales).

Weights are re-randomised as in spec/model.md §9.2 so that the SwiGLU clamps bind and the
indexer's selection is really sparse at test lengths.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from glmflash.config import ModelConfig
from glmflash.kernels.fp8_gemm import FP8_DTYPE, quantize_block_fp8
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.weights import INDEX_FILE, iter_state_dict_for_save
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer

logger = logging.getLogger(__name__)

# Kept fp32 on disk by the release (spec/model.md §7.4); everything else non-FP8 is BF16.
_FP32_SUFFIXES = ("A_log", "dt_bias", "e_score_correction_bias", "_base", "_scale")
NUM_SHARDS = 2


def make_tiny_checkpoint(out_dir: str | Path, *, seed: int = 0, variant: str = "embedded",
                         fp8: bool = True, progress: bool = True) -> Path:
    """Write config, weights, tokenizer and chat template of a tiny model into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config_dict = tiny_config(variant, fp8=fp8)
    config = ModelConfig.from_dict(config_dict)
    tensors = dict(tqdm(_disk_tensors(config, seed), desc="Making tiny checkpoint",
                        unit="tensor", disable=not progress))
    write_shards(out, tensors)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    generation = {"eos_token_id": list(config.eos_token_id), "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tiny_tokenizer(out)
    logger.info("tiny checkpoint (%s, seed %d) written to %s", variant, seed, out)
    return out


def _disk_tensors(config: ModelConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    model = GlmForCausalLM(dataclasses.replace(config, quant=None), torch.float32)
    for name, param in model.named_parameters():
        param.data.copy_(random_like(name, param.data, generator))
    yield from release_tensors(model, config)
    if config.vision is not None:
        yield from vision_tensors(config, generator)


def release_tensors(model: nn.Module, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """A plain (fp32) model's tensors in the release layout of `config`: FP8 with 128x128 block
    scales where the release is FP8, fp32 where it keeps fp32, BF16 otherwise (spec §7.4)."""
    quantized_names = _fp8_weight_names(config, type(model))
    for name, value in iter_state_dict_for_save(model):
        value = value.detach()
        if name in quantized_names:
            weight, scale = quantize_block_fp8(value, block=config.quant.weight_block_size[0])
            yield name, weight
            yield name + "_scale_inv", scale
        else:
            yield name, value.to(torch.float32 if name.endswith(_FP32_SUFFIXES) else torch.bfloat16)


def _fp8_weight_names(config: ModelConfig, model_class: type = GlmForCausalLM) -> set[str]:
    if not config.is_fp8:
        return set()
    with torch.device("meta"):
        model = model_class(config, torch.bfloat16)
    return {name for name, t in iter_state_dict_for_save(model) if t.dtype == FP8_DTYPE}


def random_like(name: str, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A random value for parameter `name` (gains near 1, fan-in scaled matrices)."""
    r = torch.randn(like.shape, generator=generator)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * r
    if name.endswith("A_log"):
        return 0.5 * r
    if like.ndim == 1:
        is_gain = "norm" in name or name.endswith("scale")
        return 1.0 + 0.1 * r if is_gain else 0.1 * r
    fan_in = like.shape[-1] if like.ndim <= 3 and "conv1d" not in name else like[0].numel()
    return r / math.sqrt(fan_in)


def vision_tensors(config: ModelConfig, generator: torch.Generator
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in vision_tensor_shapes(config).items():
        like = torch.empty(shape)
        fan_in = shape[-1] if len(shape) == 2 else like[0].numel()
        value = random_like(name, like, generator) if len(shape) == 1 else \
            torch.randn(shape, generator=generator) / math.sqrt(fan_in)
        yield name, value.to(torch.bfloat16)


def vision_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint names and shapes of the vision tower and merger (spec/model.md §7.1)."""
    v, out = config.vision, config.hidden_size
    h, head = v.hidden_size, v.hidden_size // v.num_heads
    p, t, m = v.patch_size, v.temporal_patch_size, v.spatial_merge_size
    shapes = {"model.visual.patch_embed.proj.weight": (h, v.in_channels, t, p, p),
              "model.visual.patch_embed.proj.bias": (h,)}
    for i in range(v.depth):
        b = f"model.visual.blocks.{i}."
        shapes.update({b + "norm1.weight": (h,), b + "norm2.weight": (h,),
                       b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                       b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                       b + "attn.q_norm.weight": (head,), b + "attn.k_norm.weight": (head,)})
        for proj, shape in (("gate_proj", (v.intermediate_size, h)),
                            ("up_proj", (v.intermediate_size, h)),
                            ("down_proj", (h, v.intermediate_size))):
            shapes[b + f"mlp.{proj}.weight"] = shape
            shapes[b + f"mlp.{proj}.bias"] = (shape[0],)
    pi = v.projection_intermediate_size
    shapes.update({"model.visual.post_layernorm.weight": (h,),
                   "model.visual.downsample.weight": (out, h, m, m),
                   "model.visual.downsample.bias": (out,),
                   "model.visual.merger.proj.weight": (out, out),
                   "model.visual.merger.post_projection_norm.weight": (out,),
                   "model.visual.merger.post_projection_norm.bias": (out,),
                   "model.visual.merger.gate_proj.weight": (pi, out),
                   "model.visual.merger.up_proj.weight": (pi, out),
                   "model.visual.merger.down_proj.weight": (out, pi)})
    return shapes


def write_shards(out: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Split over NUM_SHARDS files with an index, as the release is sharded."""
    names = list(tensors)
    per_shard = -(-len(names) // NUM_SHARDS)
    weight_map, total = {}, 0
    for i in range(NUM_SHARDS):
        shard = f"model-{i + 1:05d}-of-{NUM_SHARDS:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per_shard:(i + 1) * per_shard]}
        save_file(part, str(out / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def write_trained_checkpoint(out_dir: str | Path, config_dict: dict,
                             *modules: nn.Module) -> Path:
    """Write plain (fp32) trained `modules` (the network, its MTP layer) in the release layout
    of `config_dict`, with config, generation config, tokenizer and chat template."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(config_dict)
    tensors: dict[str, torch.Tensor] = {}
    for module in modules:
        tensors.update(release_tensors(module, config))
    write_shards(out, tensors)
    (out / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
    generation = {"eos_token_id": list(config.eos_token_id), "pad_token_id": config.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tiny_tokenizer(out)
    return out
