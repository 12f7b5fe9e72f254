"""A split engine's decode graphs on one GPU (a group of one rank over NCCL): rank 0's runner
sends the capture and each decode step as it would to other ranks, and its graphs replay the
all-reduces inside them; the tokens equal those of the eager single-device engine. Multi-GPU runs
are the follow-up issue's."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from glmflash import Engine
from glmflash.distributed.group import join_group
from glmflash.distributed.parallel import ParallelConfig
from glmflash.engine.parallel_runner import ParallelRunner
from glmflash.engine.ranks import RankSpec, build_rank_runner
from tests.engine.test_cuda_graph_gpu import HYBRID, _engine, _run

pytestmark = pytest.mark.gpu


def _start_one_rank(engine: Engine, log_level, warmup_ids):
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    group = join_group(0, 1, store, "cuda", timeout_s=60)
    assert group.backend == "nccl"
    engine.memory_ledger = None
    parallel = ParallelConfig(tp_size=1,
                              experts_on_rank0=engine.options.kt_num_gpu_experts is not None)
    spec = RankSpec(engine.model_path, engine.config, "cuda", engine.dtype, engine.options,
                    engine.max_seq_len, parallel)
    runner = build_rank_runner(spec, group, lambda model, plan: ParallelRunner(
        model, plan, group=group, workers=None), warmup_ids)
    return runner, runner.plan


@pytest.mark.parametrize("mode", ["all-gpu", "hybrid-3"])
def test_split_engine_graphs_replay_collectives(tiny_dirs, monkeypatch, mode):
    path = tiny_dirs["embedded"]
    eager = _engine(path, disable_cuda_graph=True, **HYBRID[mode])
    try:
        want = _run(eager)
    finally:
        eager.shutdown()
    monkeypatch.setattr(Engine, "_start_runner", _start_one_rank)
    split = _engine(path, cuda_graph_bs=[1, 2, 4, 8], **HYBRID[mode])
    try:
        assert isinstance(split.runner, ParallelRunner)
        got = _run(split)
        replays = split.runner.graphs.num_replays
    finally:
        split.shutdown()
    assert replays >= 20, "the run should decode mostly from graphs"
    assert got == want
