"""A split model equals the whole one: each rank's network built and loaded from the tiny
checkpoint, ranks run as threads whose all-reduce sums through a barrier (no processes, so every
split is checked in a second). The process-group path is tests/distributed/test_tp_engine.py."""

from __future__ import annotations

import threading

import pytest
import torch

from glmflash.config import ModelConfig
from glmflash.distributed.checkpoint import ShardedCheckpoint
from glmflash.distributed.parallel import ParallelConfig, local_config
from glmflash.distributed.sharding import build_rank_model, install_all_reduce
from glmflash.model.weights import load_checkpoint
from tests.conftest import PackedRunner, load_tiny

PROMPTS = {0: [5, 17, 300, 42, 9, 77, 1030, 3, 600, 8, 11], 1: [900, 4, 4, 250]}
# fp32 partial sums over two ranks against one: measured up to 1.0e-5 (logits up to 4.8).
SPLIT_ATOL = 3e-5


class BarrierSum:
    """All-reduce among threads: every rank gets the sum in rank order (identical everywhere)."""

    def __init__(self, world: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def reducer(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()
            t.copy_(total)
        return all_reduce


def run_split(path, parallel: ParallelConfig) -> list[torch.Tensor]:
    """Logits of every token of PROMPTS (then one decode each) on each rank of the split."""
    config = ModelConfig.from_hf(path)
    summer, outputs, errors = BarrierSum(parallel.tp_size), {}, []

    def rank_main(rank: int) -> None:
        try:
            model, plan = build_rank_model(config, parallel.for_rank(rank), torch.float32, "cpu")
            layout = ShardedCheckpoint(plan, {n for n, _ in model.named_parameters()})
            load_checkpoint(model, path, num_layers=config.num_hidden_layers, progress=False,
                            layout=layout)
            install_all_reduce(model, summer.reducer(rank))
            runner = PackedRunner(model.eval(), num_seqs=2, max_len=64)
            prefill = runner.forward(PROMPTS)
            outputs[rank] = torch.cat([prefill, runner.forward({0: [7], 1: [8]})])
        except BaseException as exc:
            errors.append(exc)
            summer.barrier.abort()
            raise

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(parallel.tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return [outputs[r] for r in range(parallel.tp_size)]


@pytest.fixture(scope="module")
def whole_logits(tiny_dirs):
    runner = PackedRunner(load_tiny(tiny_dirs["embedded"]), num_seqs=2, max_len=64)
    return torch.cat([runner.forward(PROMPTS), runner.forward({0: [7], 1: [8]})])


@pytest.mark.parametrize("parallel", [
    ParallelConfig(tp_size=2), ParallelConfig(tp_size=2, ep_size=2),
    ParallelConfig(tp_size=2, experts_on_rank0=True)], ids=["tp-experts", "ep2", "rank0-experts"])
def test_split_matches_whole(tiny_dirs, whole_logits, parallel):
    ranks = run_split(tiny_dirs["embedded"], parallel)
    for logits in ranks:
        assert (logits - whole_logits).abs().max() < SPLIT_ATOL
        assert torch.equal(logits.argmax(-1), whole_logits.argmax(-1))
    assert torch.equal(ranks[0], ranks[1]), "ranks must agree bit for bit after the all-reduce"


def test_local_config_divides_heads_and_widths(tiny_dirs):
    config = ModelConfig.from_hf(tiny_dirs["embedded"])
    local = local_config(config, ParallelConfig(tp_size=2))
    assert (local.linear_num_heads, local.num_attention_heads) == (1, 1)
    assert (local.intermediate_size, local.moe_intermediate_size) == (160, 48)
    with pytest.raises(ValueError, match="KDA heads"):
        local_config(config, ParallelConfig(tp_size=4, ep_size=1))
