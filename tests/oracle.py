"""The transformers glm5_next reference (test dependency only), on the same weights as ours."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from glmflash.kernels.fp8_gemm import FP8_DTYPE, dequantize_block_fp8
from glmflash.model.weights import checkpoint_files


def write_dequantized_copy(src: Path, dst: Path) -> Path:
    """Copy a checkpoint with FP8 weights dequantised to fp32 and no quantization_config."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    block = tuple(config.pop("quantization_config", {}).get("weight_block_size", (128, 128)))[0]
    files = checkpoint_files(src)
    tensors = {}
    for name in files:
        if name.endswith("weight_scale_inv"):
            continue
        t = _read(files, name)
        if t.dtype == FP8_DTYPE:
            t = dequantize_block_fp8(t, _read(files, name + "_scale_inv"), block=block)
        tensors[name] = t.float().contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def _read(files: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(files[name]), framework="pt") as f:
        return f.get_tensor(name)


def load_oracle(dequantized_dir: Path):
    """Glm5NextForConditionalGeneration in fp32 with eager attention and its torch KDA path."""
    from transformers import Glm5NextForConditionalGeneration
    from transformers.utils import logging as hf_logging

    _use_torch_paths()
    hf_logging.set_verbosity_error()
    model = Glm5NextForConditionalGeneration.from_pretrained(
        str(dequantized_dir), dtype=torch.float32, attn_implementation="eager")
    return model.eval()


# The modeling file's functions that it binds, at import, to flash-linear-attention's or
# causal-conv1d's kernels when those packages import (the GPU machine carries fla for the
# benchmarks). Those kernels reject the oracle's CPU tensors and are not the reference.
_PACKAGE_BOUND = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                  "causal_conv1d_fn", "causal_conv1d_update")


def _use_torch_paths() -> None:
    """Point the modeling module's package-bound functions at the torch code they wrap, whatever
    was imported first (hiding `fla` from the import only works before anyone imports it)."""
    import inspect

    from transformers.models.glm5_next import modeling_glm5_next as modeling

    for name in _PACKAGE_BOUND:
        setattr(modeling, name, inspect.unwrap(getattr(modeling, name)))


@torch.no_grad()
def oracle_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence logits `[T, V]` of one sequence alone, no cache."""
    ids = torch.tensor([token_ids])
    return model(input_ids=ids, use_cache=False).logits[0].float()


NEAR_TIE = 1e-4


def assert_greedy_matches(model, prompt: list[int], produced: list[int]) -> None:
    """Each produced token is the oracle's argmax, or its runner-up at a near-tie (< 1e-4).

    One causal forward over prompt + produced gives the next-token logits of every step.
    """
    logits = oracle_logits(model, list(prompt) + list(produced))
    for i, token in enumerate(produced):
        top2 = logits[len(prompt) - 1 + i].topk(2)
        near_tie = float(top2.values[0] - top2.values[1]) < NEAR_TIE
        assert token == int(top2.indices[0]) or (near_tie and token == int(top2.indices[1])), \
            f"step {i}: got {token}, oracle {top2.indices.tolist()} {top2.values.tolist()}"
