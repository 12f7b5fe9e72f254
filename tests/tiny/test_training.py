"""The tiny model's training path: data made from a seed, loss masks on the assistant turns,
gradients reaching every trained parameter through the model's own code."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.tiny.configs import tiny_config
from glmflash.tiny.tokenizer_files import write_tiny_tokenizer
from tools.tiny_batches import make_batch, pack_samples, sample_maker
from tools.tiny_data import SampleMaker, is_held_out, make_samples, random_task, training_tool_case
from tools.tiny_tool_tasks import tool_case, tool_conversation
from tools.tiny_train_ops import training_ops
from tools.tiny_trainer import build_models, forward_losses
from tools.tiny_vision_tasks import WORDS, image_task

CONFIG = ModelConfig.from_dict(tiny_config("trained"))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return path


def test_samples_follow_the_seed(tokenizer_dir):
    a, b = make_samples(tokenizer_dir, CONFIG, 3, 20), make_samples(tokenizer_dir, CONFIG, 3, 20)
    assert [s.ids for s in a] == [s.ids for s in b]
    assert [s.ids for s in a] != [s.ids for s in make_samples(tokenizer_dir, CONFIG, 4, 20)]


def test_batches_follow_the_seed_and_step():
    """Batch k of a run depends on (seed, k) only; no held-out question or tool is drawn."""
    maker = sample_maker(tiny_config("trained"))
    a, b = make_batch(maker, 0, 7, 4096), make_batch(maker, 0, 7, 4096)
    assert np.array_equal(a.ids, b.ids) and a.cu_seqlens == b.cu_seqlens
    assert not np.array_equal(make_batch(maker, 0, 8, 4096).ids[:64], a.ids[:64])
    assert a.cu_seqlens[-1] <= 4096


def test_training_never_draws_held_out_prompts():
    rng = random.Random(0)
    assert not any(is_held_out(random_task(rng).question) for _ in range(2000))
    names = [t["function"]["name"] for _ in range(500) for t in training_tool_case(rng).tools]
    assert not any(map(is_held_out, names))
    assert 0.05 < sum(map(is_held_out, (tool_case(rng).tools[0]["function"]["name"]
                                        for _ in range(2000)))) / 2000 < 0.2


def test_chat_loss_covers_the_assistant_turns_only(tokenizer_dir):
    maker, rng = SampleMaker(tokenizer_dir, CONFIG), random.Random(0)
    case = tool_case(rng)
    sample = maker.chat(tool_conversation(rng, case), tools=case.tools)
    trained = maker.tokenizer.decode([t for t, m in zip(sample.ids, sample.mask, strict=True) if m])
    call = f"<tool_call>{case.name}<arg_key>"
    assert trained.startswith(f"<think>The user wants the {case.noun}.")
    assert call in trained and trained.count("<|observation|>") == 1
    assert trained.endswith("<|user|>") and "# Tools" not in trained and case.user not in trained


def test_picture_tokens_are_expanded_and_unmasked(tokenizer_dir):
    maker, rng = SampleMaker(tokenizer_dir, CONFIG), random.Random(1)
    sample = maker.image_chat(image_task(rng))
    image_rows = [i for i, t in enumerate(sample.ids) if t == CONFIG.image_token_id]
    assert len(image_rows) == sum(sample.image_inputs.num_tokens) > 1
    assert not any(sample.mask[i] for i in image_rows)
    trained = maker.tokenizer.decode([t for t, m in zip(sample.ids, sample.mask, strict=True) if m])
    assert trained.startswith("<think>I see a ") and trained.endswith("<|user|>")


def test_gradients_reach_every_trained_parameter(tokenizer_dir):
    model, mtp = build_models(CONFIG, seed=0)
    maker, rng = SampleMaker(tokenizer_dir, CONFIG), random.Random(0)
    samples = [maker.image_chat(image_task(rng)), *make_samples(tokenizer_dir, CONFIG, 0, 3)]
    with training_ops(model, mtp):
        losses = forward_losses(model, mtp, pack_samples(samples))
        sum(losses[:3]).backward()
    assert losses[3] > 0 and all(torch.isfinite(x) for x in losses[:3])
    # Each expert stack is one parameter; the indexer's gradient is its own loss's.
    missing = [name for module in (model, mtp) for name, p in module.named_parameters()
               if p.requires_grad and p.grad is None]
    assert missing == []


def test_word_pictures_come_with_recipe_2_only(tokenizer_dir):
    """Recipe 1's picture stream is unchanged (the shipped checkpoint replays it); recipe 2 adds
    pictures of a written word, asked for."""
    old, new = random.Random(5), random.Random(5)
    plain = [image_task(old) for _ in range(64)]
    mixed = [image_task(new, words=True) for _ in range(64)]
    assert not any(t.answer in WORDS for t in plain)
    words = [t for t in mixed if t.question == "What word is written in the picture?"]
    assert 4 <= len(words) <= 32 and all(t.answer in WORDS for t in words)
    # Recipe 1's first pictures of this seed, as the shipped checkpoint was trained on them.
    assert [(t.question, t.answer) for t in plain[:3]] == [
        ("What colour is the background?", "white"), ("What colour is the background?", "yellow"),
        ("What colour is the square?", "blue")]
    with pytest.raises(ValueError, match="unknown data recipe"):
        SampleMaker(tokenizer_dir, CONFIG, recipe=99)
