"""The fixed-shape training step (tools/tiny_graph_step.py) on the CPU: after the warm-up, and
again after the switch to FP8-rounded weights, steps run under the frozen upload memo, which
catches an upload of batch-dependent values inside the step (a capture would replay it stale);
the memo itself. Host syncs and branches on tensor values pass on the CPU: the captured step
against the eager one is tests/tiny/test_train_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glmflash.utils.device import UploadMemo, remembered_uploads, upload
from tools import tiny_batches, tiny_graph_step
from tools.tiny_run import RunOptions, Training


def test_the_memo_gives_one_tensor_per_value_and_refuses_new_ones_when_frozen():
    memo = UploadMemo()
    with remembered_uploads(memo):
        first = upload(np.arange(4), "cpu")
        assert upload([0, 1, 2, 3], "cpu") is first
        assert upload(np.arange(4), "cpu", torch.int32) is not first
        memo.frozen = True
        assert upload(np.arange(4), "cpu") is first
        with pytest.raises(RuntimeError, match="not seen before"):
            upload(np.arange(5), "cpu")
    assert upload(np.arange(4), "cpu") is not first  # the memo is gone with its context


def test_steps_after_the_warm_up_upload_nothing_new(monkeypatch):
    """A frozen step raises on any upload of a value the warm-up did not make (a batch-dependent
    upload inside the step, which a CUDA graph would replay stale)."""
    monkeypatch.setattr(tiny_batches, "LONGEST_SAMPLE", 0)  # short sequences: a quick test
    monkeypatch.setattr(tiny_batches, "PLAN_DRAWS", 64)
    warm = tiny_graph_step.WARMUP_STEPS
    steps = 2 * warm + 2  # warm-up, one frozen step; FP8-rounded: warm-up, one frozen step
    run = Training(RunOptions(tokens_per_step=160, warmup_steps=1, graph=True,
                              qat_fraction=(warm + 1) / steps), total_steps=steps)
    try:
        losses = [run.step() for _ in range(run.total_steps)]
        assert run.is_qat and run.graph_step.warm == warm
        assert len(run.graph_step.memo.tensors) > 0
        assert torch.isfinite(torch.stack(losses)).all()
    finally:
        run.close()
