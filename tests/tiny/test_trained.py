"""The shipped trained tiny checkpoint: its manifest, its training replayed from the seed, bf16
against fp32, and the held-out eval (tools/eval_tiny.py) at the levels recorded in its manifest.

The levels come from the manifest's `eval` section, which `tools/train_tiny.py --eval` writes at
the end of training (or `python tools/eval_tiny.py --record` on an existing checkpoint): a new
checkpoint brings its own floors. Each floor is the recorded rate less one prompt's worth, so
that a CPU whose rounding differs from the recording machine's may flip one near-tie."""

from __future__ import annotations

import json

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.tiny.embedded import embedded_checkpoint
from glmflash.tiny.manifest import mismatched_files, read_manifest
from tools.eval_tiny import evaluate, mtp_acceptance
from tools.tiny_batches import make_batch, sample_maker
from tools.tiny_eval_models import load_with_mtp
from tools.tiny_train_ops import training_ops
from tools.tiny_trainer import build_models, forward_losses

CHECKPOINT = embedded_checkpoint()
MANIFEST = read_manifest(CHECKPOINT)
RECORDED = MANIFEST["eval"]
SIZES = RECORDED["sizes"]
MAX_BYTES = 4 * 2**20
BF16_GOAL = 0.90  # issue 16: bf16 vs fp32 greedy positions on the CPU


def floor(rate: float, count: int) -> float:
    """One prompt's worth below a recorded rate over `count` prompts."""
    return rate - 1 / count - 1e-9


@pytest.fixture(scope="module")
def report():
    return evaluate(CHECKPOINT, **SIZES)


def test_files_match_the_manifest():
    assert mismatched_files(CHECKPOINT) == []
    assert MANIFEST["config"] == json.loads((CHECKPOINT / "config.json").read_text())
    assert MANIFEST["training"].get("complete", True)
    assert sum(p.stat().st_size for p in CHECKPOINT.iterdir()) < MAX_BYTES


def test_weights_load_with_the_mtp_layer():
    model, mtp = load_with_mtp(CHECKPOINT)  # every tensor present, shapes and dtypes checked
    assert model.config.num_nextn_predict_layers == 1
    assert any(p.dtype == torch.float8_e4m3fn for p in mtp.parameters())


def test_training_replays_from_the_seed():
    """The initial weights and first data of the manifest's seed give the losses the run
    recorded before its first update (fp32, on the CPU)."""
    training = MANIFEST["training"]
    if "probe" not in training:
        pytest.skip("the shipped checkpoint was made by the previous trainer, whose data stream "
                    "(one stream for the whole run) tools/tiny_batches.py no longer makes")
    probe = training["probe"]
    models = build_models(ModelConfig.from_dict(MANIFEST["config"]), training["seed"])
    maker = sample_maker(MANIFEST["config"], training.get("recipe_version", 1))
    batch = make_batch(maker, training["seed"], 0, probe["tokens"])
    with training_ops(*models), torch.no_grad():
        loss, mtp_loss, index_loss, num_trained = forward_losses(*models, batch)
    assert num_trained == probe["trained_tokens"]
    assert loss.item() == pytest.approx(probe["loss"], rel=1e-4)
    assert mtp_loss.item() == pytest.approx(probe["mtp_loss"], rel=1e-4)
    assert index_loss.item() == pytest.approx(probe["indexer_loss"], rel=1e-4)


def test_bf16_greedy_agrees_with_fp32(report):
    agreement, recorded = report["bf16_vs_fp32"], RECORDED["bf16_vs_fp32"]
    print(agreement)
    assert agreement["num_prompts"] == SIZES["num_compare"]
    assert recorded["position_agreement"] >= BF16_GOAL
    assert agreement["position_agreement"] >= floor(recorded["position_agreement"],
                                                    SIZES["num_compare"])


def test_eval_rates_hold(report):
    print(json.dumps({k: report[k] for k in ("tasks", "tools", "images", "mtp_agreement")}))
    num_tasks = 3 * SIZES["per_family"]
    assert report["tasks"]["exact_match"] >= floor(RECORDED["tasks"]["exact_match"], num_tasks)
    for measure in ("tool_call_rate", "right_call"):
        assert report["tools"][measure] >= floor(RECORDED["tools"][measure],
                                                 SIZES["num_tools"]), measure
    for pictures in ("images", "words"):
        if pictures in RECORDED:  # (words: checkpoints of data recipe 2 on)
            assert report[pictures]["exact_match"] >= floor(
                RECORDED[pictures]["exact_match"], SIZES["per_family"]), pictures
    assert report["mtp_agreement"] >= RECORDED["mtp_agreement"] - 0.02
    for family in ("arithmetic", "copy", "recall"):
        assert report["tasks"][family]["reasoning_split"] >= 0.9, family


def test_mtp_acceptance_is_the_agreement_on_the_draft_schedule():
    """Greedy decoding with one MTP draft a step accepts exactly the drafts that the MTP
    layer's teacher-forced agreement with the main model predicts for the positions drafted
    (`scheduled_acceptance`): the draft after an accepted one skips a position, the draft after
    a rejected one does not, so acceptance sits below the agreement over every position where
    misses come in runs (0.9645 against 0.9811 on the eval's tasks, bench/RESULTS.md)."""
    report = mtp_acceptance(CHECKPOINT, seed=1000, per_family=4)
    scheduled = report["agreement_on_the_draft_schedule"]
    assert scheduled["drafts"] == report["num_draft_tokens"] > 0
    assert scheduled["accepted"] == report["num_accepted_tokens"]
