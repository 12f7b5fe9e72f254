"""load_format="dummy": a checkpoint folder without weights runs on seeded in-memory weights."""

from __future__ import annotations

import json

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.options import EngineConfig
from glmflash.kernels.fp8_gemm import FP8_DTYPE, dequantize_block_fp8
from glmflash.model.dummy_weights import fill_dummy_weights
from glmflash.model.moe import StackedWeight
from glmflash.model.weights import CheckpointError
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer

ENGINE = dict(device="cpu", dtype="float32", background_loop=False, context_length=256)


@pytest.fixture(scope="module")
def config_only_dir(tmp_path_factory):
    """config.json and the tokenizer files of the tiny model, and no safetensors."""
    root = tmp_path_factory.mktemp("config-only")
    (root / "config.json").write_text(json.dumps(tiny_config("embedded")))
    write_tiny_tokenizer(root)
    return root


def _greedy(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = engine.generate(["The quick brown fox", "GLM runs on random weights"], params)
    return [r.token_ids for r in results]


def test_two_dummy_engines_generate_the_same_tokens(config_only_dir):
    first = Engine(config_only_dir, load_format="dummy", **ENGINE)
    tokens = _greedy(first)
    assert all(len(t) == 12 for t in tokens)
    # Not a constant stream: the random model still tells tokens apart.
    assert len({t for seq in tokens for t in seq}) > 3
    assert _greedy(Engine(config_only_dir, load_format="dummy", **ENGINE)) == tokens
    for name, param in first.runner.model.named_parameters():
        assert torch.isfinite(param.data.float()).all(), name
        if param.dtype == FP8_DTYPE:
            codes = param.data.view(torch.uint8)
            assert not ((codes & 0x7F) == 0x7F).any(), f"{name} holds NaN codes"


def test_a_folder_without_weights_needs_dummy(config_only_dir):
    with pytest.raises(CheckpointError, match=r"neither model\.safetensors\.index\.json nor any "
                                              r"\*\.safetensors"):
        Engine(config_only_dir, **ENGINE)


def test_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="load_format 'pt' must be one of"):
        EngineConfig(load_format="pt")


def test_fp8_weights_look_like_a_checkpoint():
    """Codes spread as an amax-quantised Gaussian (few subnormals, no NaN); dequantised ~0.02."""
    weight = StackedWeight(16, 512, 1024, torch.float32, fp8_block=128)
    fill_dummy_weights(weight, seed=3)
    codes = weight.weight.data.view(torch.uint8)
    assert not ((codes & 0x7F) == 0x7F).any()
    subnormal = ((codes & 0x78) == 0) & ((codes & 0x07) != 0)
    assert 1e-5 < subnormal.float().mean().item() < 1e-3
    scales = weight.weight_scale_inv.data
    assert (scales > 1e-4).all() and (scales < 4e-4).all()
    values = dequantize_block_fp8(weight.weight.data[0], scales[0], block=128)
    assert 0.015 < values.std().item() < 0.025


def test_load_format_flags():
    from glmflash.cli import build_parser as cli_parser
    from glmflash.server.args import build_parser, engine_options

    assert engine_options(build_parser().parse_args(["--load-format", "dummy"])) == \
        {"load_format": "dummy"}
    assert "load_format" not in engine_options(build_parser().parse_args([]))
    args = cli_parser().parse_args(["generate", "--prompt", "hi", "--load-format", "dummy"])
    assert args.load_format == "dummy"


def test_fake_context_makes_the_next_step_a_pure_decode(config_only_dir):
    """bench/common.py's fill_fake_context: pages and slot taken, the context counts computed."""
    from bench.common import add_fake_context_requests

    engine = Engine(config_only_dir, load_format="dummy", check_integrity=True, **ENGINE)
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    seqs = add_fake_context_requests(engine, 3, 150, params)
    engine.check_integrity()
    assert [s.num_computed_tokens for s in seqs] == [150] * 3
    assert all(len(s.page_ids) * engine.cache.page_size >= 150 for s in seqs)
    scheduled, run = [], engine.runner.run
    engine.runner.run = lambda batch: scheduled.append(list(batch.num_tokens)) or run(batch)
    while engine.scheduler.has_work:
        engine.step()
    assert scheduled == [[1, 1, 1], [1, 1, 1]]
    assert [s.num_output_tokens for s in seqs] == [2] * 3
