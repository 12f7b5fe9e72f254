"""What every rank of a split model does: load its part, agree on one cache plan, and (ranks
other than 0) run the steps rank 0 sends until told to stop.

A failure at load is exchanged among all ranks, so each stops with the same report; a failure in
a step is left in the store and the rank exits, which breaks the collectives of the others.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from glmflash.config import ModelConfig
from glmflash.distributed.checkpoint import ShardedCheckpoint
from glmflash.distributed.group import RankFailed, RankGroup, join_group
from glmflash.distributed.parallel import ParallelConfig, expert_range
from glmflash.distributed.sharding import build_rank_model, install_all_reduce
from glmflash.engine.model_runner import DUMMY_WEIGHT_SEED, ModelRunner, place_model, plan_cache
from glmflash.engine.options import EngineConfig
from glmflash.model.dummy_weights import fill_dummy_weights
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.weights import load_checkpoint
from glmflash.utils import env
from glmflash.utils.logging import setup_logging

logger = logging.getLogger(__name__)
# Messages from rank 0: a varlen step, a step of decodes (replayed from a graph where rank 0
# replays one), capture the decode graphs, stop.
STEP, DECODE, CAPTURE, STOP = "step", "decode", "capture", "stop"


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its part of the engine (sent to spawned ranks)."""

    model_path: Path
    config: ModelConfig
    device_type: str
    dtype: torch.dtype
    options: EngineConfig
    max_seq_len: int
    parallel: ParallelConfig
    store_port: int | None = None
    """The rendezvous store on this host (spawned ranks); None under torchrun (env://)."""
    log_level: str | None = None


def build_rank_runner(spec: RankSpec, group: RankGroup, make_runner=ModelRunner,
                      warmup_ids: list[int] | None = None) -> ModelRunner:
    """Load this rank's part, agree on one cache plan, build the runner. Every rank learns every
    rank's outcome of each phase, so a failure anywhere ends every rank (the failing rank
    re-raises its own error, the others raise RankFailed naming it)."""
    def load():
        maybe_fail("load", spec.parallel.rank)
        model = load_rank_model(spec, group, warmup_ids)
        return model, plan_cache(model.config, spec.options, spec.max_seq_len, group.device,
                                 spec.dtype)

    (model, plan), pages = _on_every_rank(group, load, "at load",
                                          share=lambda loaded: loaded[1].num_pages)
    # Every rank addresses the same pages: the smallest budget decides.
    plan = dataclasses.replace(plan, num_pages=min(pages))
    runner, _ = _on_every_rank(group, lambda: make_runner(model, plan), "building its runner")
    return runner


def _on_every_rank(group: RankGroup, phase, when: str, share=lambda result: None):
    """Run `phase` here and learn every rank's outcome. Returns this rank's result and every
    rank's `share(result)`; raises this rank's own error, or RankFailed naming another's."""
    try:
        result = phase()
        status = (None, share(result))
    except Exception as exc:
        result, status = exc, (f"{type(exc).__name__}: {exc}", None)
    outcomes = group.exchange(status)
    if status[0] is not None:
        raise result
    failed = {rank: error for rank, (error, _) in enumerate(outcomes) if error}
    if failed:
        raise RankFailed(describe_failures(failed, when))
    return result, [value for _, value in outcomes]


def load_rank_model(spec: RankSpec, group: RankGroup,
                    warmup_ids: list[int] | None = None) -> GlmForCausalLM:
    parallel, options, device = spec.parallel, spec.options, group.device
    # Hybrid CPU experts live on rank 0 only (computed once per step, not once per rank).
    hybrid = device.type == "cuda" and options.kt_num_gpu_experts is not None \
        and expert_range(spec.config, parallel)[1] > 0
    model, plan = build_rank_model(spec.config, parallel, spec.dtype,
                                   "cpu" if hybrid else device)
    if options.load_format == "dummy":
        fill_dummy_weights(model, seed=DUMMY_WEIGHT_SEED + parallel.rank)
    else:
        params = {name for name, _ in model.named_parameters()}
        load_checkpoint(model, spec.model_path, num_layers=spec.config.num_hidden_layers,
                        progress=parallel.rank == 0, layout=ShardedCheckpoint(plan, params))
    install_all_reduce(model, group.all_reduce)
    if device.type == "cpu":
        options = _share_cpu_cores(parallel.tp_size, options)
    return place_model(model, device, options, hybrid, warmup_ids)


def serve_steps(runner: ModelRunner, group: RankGroup) -> None:
    """Ranks other than 0: run each step rank 0 sends (no sampling: logits stay on rank 0)."""
    num_steps = 0
    while True:
        kind, message = group.receive()
        if kind == STOP:
            return
        num_steps += 1
        maybe_fail(f"step{num_steps}", group.rank)
        if kind == CAPTURE:
            runner.capture_graphs(message)
        elif kind == DECODE:
            runner.run_decode(message)
        else:
            runner.run_inputs(dataclasses.replace(message, logit_seqs=[],
                                                  extra_logit_rows=None))


ALIVE_KEY = "glmflash/alive/{}"
"""Set by a spawned rank once it has reached rank 0's store (`WorkerSet.wait_until_alive`)."""


def worker_main(rank: int, spec: RankSpec) -> None:
    """Entry of a rank spawned by rank 0 (rank 0 owns Ctrl-C and tells the others to stop)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    setup_logging(spec.log_level)
    maybe_fail("start", rank)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.parallel.tp_size, is_master=False,
                          timeout=timedelta(seconds=env.dist_timeout_s()))
    store.set(ALIVE_KEY.format(rank), "1")
    run_worker(rank, spec, store)


def run_worker(rank: int, spec: RankSpec, store) -> None:
    group = join_group(rank, spec.parallel.tp_size, store, spec.device_type, env.dist_timeout_s(),
                       same_host=spec.store_port is not None)
    spec = dataclasses.replace(spec, parallel=spec.parallel.for_rank(rank))
    try:
        runner = build_rank_runner(spec, group)
    except Exception as exc:
        # Rank 0 reports it (every rank's load outcome was exchanged).
        logger.error("rank %d: not started: %s", rank, exc)
        group.close()
        sys.exit(1)
    try:
        serve_steps(runner, group)
    except BaseException as exc:  # noqa: B036 - any failure must reach rank 0, then exit
        group.post_error(f"{type(exc).__name__}: {exc}")
        logger.error("rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        # NOTE: no clean teardown: the other ranks may wait inside a collective; exiting closes
        # this rank's connections, which ends their wait with an error.
        os._exit(1)
    group.close()


def describe_failures(failed: dict[int, str], when: str) -> str:
    return "; ".join(f"rank {rank} failed {when}: {error}"
                     for rank, error in sorted(failed.items()))


def _share_cpu_cores(world_size: int, options: EngineConfig) -> EngineConfig:
    """Ranks on one host split its cores rather than each using all of them."""
    cores = max(1, (os.cpu_count() or 1) // world_size)
    torch.set_num_threads(cores)
    logger.info("CPU ranks: %d threads each", cores)
    if options.kt_cpuinfer is not None:
        return options
    return dataclasses.replace(options, kt_cpuinfer=max(cores, options.kt_threadpool_count))


def maybe_fail(point: str, rank: int) -> None:
    """Test hook: GLMFLASH_TEST_FAULT="<rank>:<point>" raises there ("start", "load",
    "step<n>")."""
    if env.test_fault() == f"{rank}:{point}":
        raise RuntimeError(f"injected fault at {point} (GLMFLASH_TEST_FAULT)")
