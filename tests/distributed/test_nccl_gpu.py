"""The NCCL path on one GPU (a group of one rank): a rank's network loaded through the split
loader with an all-reduce after every mixer and FFN, with all experts on the GPU and with the
hybrid CPU experts on rank 0, against the single-device model; and an all-reduce inside a
captured CUDA graph (how the split model's decode graphs carry their collectives). Multi-GPU
runs are the follow-up issue's."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from glmflash.config import ModelConfig
from glmflash.distributed.group import join_group
from glmflash.distributed.parallel import ParallelConfig
from glmflash.engine.model_runner import load_model
from glmflash.engine.options import EngineConfig
from glmflash.engine.ranks import RankSpec, build_rank_runner
from tests.conftest import PackedRunner

pytestmark = pytest.mark.gpu

# fp32; the hybrid path sums experts in another order (tests/engine/test_experts_gpu.py).
ATOL = 2e-4


@pytest.fixture(scope="module")
def nccl_group():
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60))
    group = join_group(0, 1, store, "cuda", timeout_s=60)
    assert group.backend == "nccl"
    yield group
    group.close()


def _logits(model, prompts, step) -> torch.Tensor:
    runner = PackedRunner(model, len(prompts), device="cuda")
    return torch.cat([runner.forward(dict(enumerate(prompts))).cpu(), runner.forward(step).cpu()])


@pytest.mark.parametrize("options", [EngineConfig(), EngineConfig(kt_num_gpu_experts=3)],
                         ids=["gpu-experts", "hybrid-rank0"])
def test_rank_model_over_nccl_matches_one_device(tiny_dirs, nccl_group, options):
    path = tiny_dirs["embedded"]
    config = ModelConfig.from_hf(path)
    prompts, step = [[5, 17, 300, 42, 9, 77, 11], [900, 4]], {0: [7], 1: [8]}
    expected = _logits(load_model(path, config, torch.device("cuda"), torch.float32, options),
                       prompts, step)
    parallel = ParallelConfig(tp_size=1, experts_on_rank0=options.kt_num_gpu_experts is not None)
    spec = RankSpec(path, config, "cuda", torch.float32, options, 256, parallel)
    runner = build_rank_runner(spec, nccl_group)
    got = _logits(runner.model, prompts, step)
    assert (got - expected).abs().max() < ATOL


def test_all_reduce_inside_a_cuda_graph(nccl_group):
    x = torch.ones(4096, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # NCCL's lazy set-up must happen before capture
        nccl_group.all_reduce(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x * 2
        nccl_group.all_reduce(y)
    x.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(y, 6.0))
