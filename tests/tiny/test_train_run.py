"""A whole training run on the CPU at smoke size (two steps of 256 tokens): the checkpoint in
the release layout, its manifest and loss log, the tar, and the FP8-rounded final steps."""

from __future__ import annotations

import csv
import tarfile

from glmflash.tiny.manifest import mismatched_files, read_manifest
from tools.tiny_eval_models import load_with_mtp
from tools.tiny_run import RunOptions
from tools.train_tiny import train


def test_a_smoke_run_writes_a_loadable_checkpoint(tmp_path):
    out, tar = tmp_path / "tiny_trained", tmp_path / "out" / "tiny_trained.tar"
    options = RunOptions(tokens_per_step=256, warmup_steps=1, qat_fraction=0.5, gap_tokens=256)
    summary = train(out, options, steps=2, minutes=None, checkpoint_minutes=60, tar=tar)
    assert summary["complete"] and summary["steps"] == 2
    assert set(summary["fp8_rounding"]) == {"loss_fp32", "loss_fp8", "mtp_loss_fp32",
                                            "mtp_loss_fp8"}
    assert read_manifest(out)["training"] == summary and mismatched_files(out) == []
    with open(out / "loss_log.csv") as f:
        assert [int(row["step"]) for row in csv.DictReader(f)] == [0, 1]
    with tarfile.open(tar) as archive:
        assert sorted(archive.getnames())[1:] == sorted(f"tiny_trained/{p.name}"
                                                        for p in out.iterdir())
    model, mtp = load_with_mtp(out)
    assert model.config.num_nextn_predict_layers == 1
