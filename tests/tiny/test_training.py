"""The tiny model's training path: data made from a seed, loss masks on the assistant turns,
gradients reaching every trained parameter through the model's own code."""

from __future__ import annotations

import random

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer
from tools.tiny_data import SampleMaker, make_samples
from tools.tiny_tool_tasks import tool_case, tool_conversation
from tools.tiny_trainer import build_models, forward_losses


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return path


def test_samples_follow_the_seed(tokenizer_dir):
    a, b = make_samples(tokenizer_dir, 3, 20), make_samples(tokenizer_dir, 3, 20)
    assert [s.ids for s in a] == [s.ids for s in b]
    assert [s.ids for s in a] != [s.ids for s in make_samples(tokenizer_dir, 4, 20)]


def test_chat_loss_covers_the_assistant_turns_only(tokenizer_dir):
    maker, rng = SampleMaker(tokenizer_dir), random.Random(0)
    case = tool_case(rng)
    sample = maker.chat(tool_conversation(rng, case), tools=case.tools)
    trained = maker.tokenizer.decode([t for t, m in zip(sample.ids, sample.mask) if m])
    call = f"<tool_call>{case.name}<arg_key>"
    assert trained.startswith(f"<think>The user wants the {case.noun}.")
    assert call in trained and trained.count("<|observation|>") == 1
    assert trained.endswith("<|user|>") and "# Tools" not in trained and case.user not in trained


def test_gradients_reach_every_trained_parameter(tokenizer_dir):
    config = ModelConfig.from_dict(tiny_config("trained"))
    model, mtp = build_models(config, seed=0)
    loss, mtp_loss, num_trained = forward_losses(model, mtp,
                                                 make_samples(tokenizer_dir, 0, 3))
    (loss + mtp_loss).backward()
    assert num_trained > 0 and torch.isfinite(loss) and torch.isfinite(mtp_loss)
    # The vision tower has no image in these samples (each expert stack is one parameter).
    missing = [name for module in (model, mtp) for name, p in module.named_parameters()
               if p.requires_grad and p.grad is None and ".visual." not in name]
    assert missing == []
    assert all(p.grad is None for name, p in model.named_parameters() if ".indexer." in name)
