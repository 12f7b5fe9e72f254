"""Rank 0 of a split model: it starts the other ranks (spawned processes on this host, or the
processes torchrun started), sends each step's inputs before running the step itself, and stops
every rank on shutdown. Any failure inside a step is fatal: the ranks are then out of step."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from glmflash.distributed.group import ERROR_WAIT_S, RankFailed, RankGroup, abort_group, join_group
from glmflash.engine.model_runner import DecodeStep, ModelRunner
from glmflash.engine.ranks import (
    ALIVE_KEY,
    CAPTURE,
    DECODE,
    STEP,
    STOP,
    RankSpec,
    build_rank_runner,
    describe_failures,
    maybe_fail,
    run_worker,
    worker_main,
)
from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.step_inputs import StepInputs
from glmflash.utils import env

logger = logging.getLogger(__name__)
STOP_TIMEOUT_S = 10.0
ALIVE_POLL_S = 0.05


class WorkerSet:
    """The ranks 1..N-1 spawned by rank 0; a watcher reports the death of any of them."""

    def __init__(self, spec: RankSpec) -> None:
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=worker_main, args=(rank, spec), daemon=True,
                                          name=f"glmflash-rank{rank}")
                          for rank in range(1, spec.parallel.tp_size)]
        # CPU ranks share the host's cores: their OpenMP threads must not spin once idle (a
        # spinning rank takes the core another rank computes on).
        with _environ("GOMP_SPINCOUNT", "0") if spec.device_type == "cpu" \
                else contextlib.nullcontext():
            for process in self.processes:
                process.start()
        self.closing = False
        self.on_death = None
        self._reaping = threading.Lock()
        """Held around every look at the processes' state: two threads reaping one child at
        once (the watcher and `stop`) leave one of them taking it for alive."""
        threading.Thread(target=self._watch, name="glmflash-rank-watch", daemon=True).start()

    def wait_until_alive(self, store, timeout_s: float) -> None:
        """Until every rank has reached the store (`ALIVE_KEY`). A rank that exits before (a
        script without a `__main__` guard, which each spawned rank runs again, dies there) is
        reported at once, where the process group's join would wait out its whole timeout."""
        keys = [ALIVE_KEY.format(rank) for rank in range(1, len(self.processes) + 1)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            if codes := self.exit_codes():
                raise RankFailed("; ".join(f"rank {rank} exited with code {code} before it "
                                           f"started" for rank, code in codes.items()))
            if time.monotonic() > deadline:
                raise RankFailed(f"the ranks did not start within {timeout_s:.0f} s")
            time.sleep(ALIVE_POLL_S)

    def exit_codes(self) -> dict[int, int]:
        """rank -> exit code of the ranks that have exited."""
        with self._reaping:
            codes = {rank: p.exitcode for rank, p in enumerate(self.processes, 1)}
        return {rank: code for rank, code in codes.items() if code is not None}

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait up to `timeout_s` for the ranks to exit, then end those that have not."""
        self.closing = True
        deadline = time.monotonic() + timeout_s
        with self._reaping:
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
            for process in self.processes:
                if process.is_alive():
                    if timeout_s:
                        logger.warning("%s did not exit; terminating it", process.name)
                    process.terminate()
                    process.join(STOP_TIMEOUT_S)
                if process.is_alive():
                    process.kill()
                    process.join()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        while sentinels:
            for ready in multiprocessing.connection.wait(list(sentinels)):
                rank = sentinels.pop(ready)
                with self._reaping:
                    code = self.processes[rank - 1].exitcode
                if not self.closing and self.on_death is not None:
                    self.on_death(rank, code)


class ParallelRunner(ModelRunner):
    """Rank 0's runner: each step's inputs go to the other ranks, then the step runs here."""

    def __init__(self, model, plan, *, group: RankGroup, workers: WorkerSet | None) -> None:
        super().__init__(model, plan)
        self.plan = plan
        self.group, self.workers = group, workers
        self.failure: RankFailed | None = None
        self.closed = False
        self.num_steps = 0
        if workers is not None:
            workers.on_death = self._rank_died

    def run_inputs(self, inputs: StepInputs) -> torch.Tensor:
        # Device tensors would be unpickled onto rank 0's device: the rows travel on the host.
        self._send(STEP, dataclasses.replace(inputs, embed_rows=[
            (row, t.cpu()) for row, t in inputs.embed_rows]))
        return super().run_inputs(inputs)

    def run_decode(self, step: DecodeStep) -> torch.Tensor:
        self._send(DECODE, step)
        return super().run_decode(step)

    def capture_graphs(self, batch_sizes: list[int]) -> None:
        # Every rank captures the same graphs in the same order: the warm-up forwards before
        # each capture run the all-reduces, and the captured ones replay together.
        self._send(CAPTURE, batch_sizes)
        super().capture_graphs(batch_sizes)

    def _send(self, kind: str, message: object) -> None:
        self.group.send((kind, message))
        self.num_steps += 1
        # The other ranks now wait in this step's first all-reduce.
        maybe_fail(f"step{self.num_steps}", 0)

    def run(self, batch: ScheduledBatch):
        if self.failure is not None:
            raise self.failure
        try:
            return super().run(batch)
        except Exception as exc:
            self.failure = RankFailed(self._explain(exc))
            raise self.failure from exc
        except BaseException:
            # Interrupted mid-step (Ctrl-C): the other ranks may wait in this step's
            # collectives, which cannot complete now; they are stopped without waiting.
            self.failure = RankFailed("rank 0 was interrupted in a step")
            self._abort_collectives()
            raise

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (terminated past a timeout)."""
        if self.closed:
            return
        self.closed = True
        super().close()
        if self.failure is None:
            try:
                self.group.send((STOP, None))
            except Exception:
                logger.warning("could not send the stop message", exc_info=True)
        if self.workers is not None:
            # After a failure the other ranks may wait in a collective that cannot complete.
            self.workers.stop(timeout_s=0.0 if self.failure else STOP_TIMEOUT_S)
        close_group(self.group, failed=self.failure is not None)

    def _explain(self, exc: Exception) -> str:
        # A broken collective means another rank failed: give it time to say why.
        broken = isinstance(exc, getattr(dist, "DistError", ())) or \
            any(word in str(exc) for word in ("gloo", "NCCL", "Connection"))
        errors = self.group.posted_errors(wait_s=ERROR_WAIT_S if broken else 0.0)
        codes = self.workers.exit_codes() if self.workers is not None else {}
        if errors:
            return describe_failures(errors, "in a step")
        exited = ", ".join(f"rank {r} exited with code {c}" for r, c in sorted(codes.items()))
        return f"rank 0 failed in a step: {type(exc).__name__}: {exc}" + \
            (f" ({exited})" if exited else "")

    def _rank_died(self, rank: int, code: int | None) -> None:
        logger.error("rank %d exited unexpectedly (code %s)", rank, code)
        self._abort_collectives()

    def _abort_collectives(self) -> None:
        """Make ranks waiting in a collective give up: NCCL would wait for a rank that will
        not come until its timeout, and so would the shared-memory all-reduce; gloo fails on
        its own."""
        if self.group.host_reduce is not None:
            self.group.host_reduce.abort()
        if self.group.backend == "nccl":
            abort_group()


@contextlib.contextmanager
def _environ(name: str, value: str):
    """`name` set to `value` inside the block (spawned processes read the environment as it is
    at `start`), as it was after."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def close_group(group: RankGroup, *, failed: bool) -> None:
    """Leave the process groups, so that this process can start another split engine."""
    if failed and group.backend == "nccl":
        abort_group()
    try:
        group.close()
    except Exception:
        logger.warning("could not leave the process group cleanly", exc_info=True)


def start_ranks(spec: RankSpec, warmup_ids: list[int] | None = None) -> ParallelRunner:
    """Rank 0: start (or join) the other ranks, load this rank's part, return its runner.

    Under torchrun the ranks other than 0 serve steps here and exit when rank 0 stops them.
    """
    if _launched_by_torchrun():
        return _start_under_torchrun(spec, warmup_ids)
    store = dist.TCPStore("127.0.0.1", 0, spec.parallel.tp_size, is_master=True,
                          timeout=timedelta(seconds=env.dist_timeout_s()),
                          wait_for_workers=False)
    workers = WorkerSet(dataclasses.replace(spec, store_port=store.port))
    group = None
    try:
        workers.wait_until_alive(store, env.dist_timeout_s())
        group = join_group(0, spec.parallel.tp_size, store, spec.device_type,
                           env.dist_timeout_s(), same_host=True)
        return build_rank_runner(spec, group, lambda model, plan: ParallelRunner(
            model, plan, group=group, workers=workers), warmup_ids)
    except BaseException as exc:
        # After RankFailed every rank knows (the outcome was exchanged) and is leaving.
        workers.stop(timeout_s=STOP_TIMEOUT_S if isinstance(exc, RankFailed) else 0.0)
        if group is not None:
            close_group(group, failed=not isinstance(exc, RankFailed))
        raise


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or \
        ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ)


def _start_under_torchrun(spec: RankSpec, warmup_ids: list[int] | None) -> ParallelRunner:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != spec.parallel.tp_size:
        raise ValueError(f"torchrun started {world} processes for tp_size "
                         f"{spec.parallel.tp_size}; they must be equal")
    # torchrun's agent may host the store already; otherwise rank 0 does.
    is_master = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=is_master, timeout=timedelta(seconds=env.dist_timeout_s()),
                          wait_for_workers=False)
    if rank > 0:
        run_worker(rank, spec, store)
        raise SystemExit(0)
    group = join_group(0, world, store, spec.device_type, env.dist_timeout_s())
    return build_rank_runner(spec, group, lambda model, plan: ParallelRunner(
        model, plan, group=group, workers=None), warmup_ids)
