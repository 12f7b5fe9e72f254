"""Checkpoint loading: both layouts load; every bad-checkpoint case names the tensor and file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmflash.config import ModelConfig
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.weights import CheckpointError, load_checkpoint
from tests.conftest import PackedRunner, load_tiny
from tests.model.test_cpu_experts import NUMBA_VS_REF_ATOL

L0 = "model.language_model.layers.0."
L3 = "model.language_model.layers.3."
SHARD1 = "model-00001-of-00002.safetensors"


@pytest.fixture
def ckpt(tiny_dirs, tmp_path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dirs["embedded"], dst)
    return dst


def _load(path: Path):
    config = ModelConfig.from_hf(path)
    model = GlmForCausalLM(config, torch.float32)
    return load_checkpoint(model, path, num_layers=config.num_hidden_layers, progress=False)


def _edit(path: Path, name: str, fn) -> Path:
    """Apply fn(tensors) to the shard holding `name`; keeps the index consistent."""
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"][name]
    tensors = load_file(str(path / shard))
    fn(tensors)
    save_file(tensors, str(path / shard))
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update(dict.fromkeys(tensors, shard))
    index_file.write_text(json.dumps(index))
    return path / shard


@pytest.mark.parametrize("name", [L0 + "self_attn.A_log", L3 + "mlp.experts.5.up_proj.weight",
                                  L3 + "mlp.experts.5.up_proj.weight_scale_inv"])
def test_missing_tensor_is_named(ckpt, name):
    _edit(ckpt, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing 1 tensors: {name.replace('.', '[.]')}"):
        _load(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    name = L0 + "self_attn.q_proj.weight"
    bad = L0 + "self_attn.mystery.weight"
    shard = _edit(ckpt, name, lambda t: t.__setitem__(bad, torch.zeros(2)))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {bad}.*{shard.name}"):
        _load(ckpt)


def test_out_of_range_expert_is_named(ckpt):
    name = L0 + "self_attn.q_proj.weight"
    bad = L3 + "mlp.experts.99.down_proj.weight"
    _edit(ckpt, name, lambda t: t.__setitem__(bad, torch.zeros(2)))
    with pytest.raises(CheckpointError, match=rf"{bad}.*expert 99 is out of range"):
        _load(ckpt)


def test_misshaped_tensor_is_named(ckpt):
    name = L0 + "self_attn.q_proj.weight"
    misshaped = torch.zeros(3, 5, dtype=torch.bfloat16)
    shard = _edit(ckpt, name, lambda t: t.__setitem__(name, misshaped))
    with pytest.raises(CheckpointError, match=rf"{name} in .*{shard.name} has shape \(3, 5\)"):
        _load(ckpt)


@pytest.mark.parametrize("name,dtype,expect", [
    (L3 + "mlp.shared_experts.up_proj.weight", torch.bfloat16, "F8_E4M3"),
    (L3 + "mlp.shared_experts.up_proj.weight_scale_inv", torch.bfloat16, "F32"),
    (L0 + "self_attn.o_proj.weight", torch.int32, "a float type"),
])
def test_wrong_dtype_is_named(ckpt, name, dtype, expect):
    def retype(t):
        t[name] = t[name].to(torch.float32).to(dtype)
    _edit(ckpt, name, retype)
    with pytest.raises(CheckpointError, match=rf"{name} in .* expected {expect}"):
        _load(ckpt)


def test_truncated_shard_is_named(ckpt):
    shard = ckpt / SHARD1
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=SHARD1):
        _load(ckpt)


def test_missing_shard_and_bad_index(ckpt):
    (ckpt / SHARD1).unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {SHARD1}, which is missing"):
        _load(ckpt)
    (ckpt / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a safetensors index"):
        _load(ckpt)


def test_folder_without_weights(tmp_path, ckpt):
    shutil.copy(ckpt / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weights in .*any \\*.safetensors file"):
        _load(tmp_path)


def test_mtp_block_is_recognised_and_skipped(ckpt):
    name = L0 + "self_attn.q_proj.weight"
    mtp = "model.language_model.layers.6."
    _edit(ckpt, name, lambda t: t.update({mtp + "eh_proj.weight": torch.zeros(4, 8),
                                          mtp + "shared_head.norm.weight": torch.zeros(4)}))
    report = _load(ckpt)
    assert any("MTP" in reason and n == 2 for reason, n in report.skipped.items())


def test_unquantised_save_pretrained_layout_loads(ckpt, oracles, tmp_path):
    """transformers' save_pretrained output (fp32, no FP8) gives the same logits as the FP8 one."""
    saved = tmp_path / "saved"
    oracles["embedded"].save_pretrained(saved)
    prompt = list(range(3, 40))
    fp8_logits = PackedRunner(load_tiny(ckpt), 1).forward({0: prompt})
    plain_logits = PackedRunner(load_tiny(saved), 1).forward({0: prompt})
    assert ModelConfig.from_hf(saved).quant is None
    # FP8 experts run on the numba kernel, plain ones on the loop: summation order only.
    assert (fp8_logits - plain_logits).abs().max().item() < NUMBA_VS_REF_ATOL


@pytest.mark.parametrize("index", [[1, 2], {"weight_map": ["a"]}], ids=["list", "map_list"])
def test_an_index_that_is_not_an_object_is_named(ckpt, index):
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        _load(ckpt)
