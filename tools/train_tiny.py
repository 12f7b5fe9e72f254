"""Train the tiny model (the `trained` variant of glmflash/tiny/configs.py) and write it in the
release layout with a manifest and its loss log:

    python tools/train_tiny.py OUT_DIR [--device cuda] [--minutes 5 | --steps N]
        [--tokens-per-step 32768] [--graph] [--workers 8] [--tar OUT.tar] [--eval]

The network is the project's own (glmflash.model) with the reference ops under autograd
(tools/tiny_trainer.py); the data is made by tools/tiny_batches.py from the seed, batch k from
its own stream. With `--minutes` the run times its first steps and fixes the number of steps
that fills the budget (the learning-rate schedule follows it; the manifest records it, and
`--steps` with that number replays the run). OUT_DIR (and `--tar`) hold a complete checkpoint
every `--checkpoint-minutes`, so a run stopped from outside still leaves a model. `--eval` runs
tools/eval_tiny.py on the result and records its figures in the manifest.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

import torch

from glmflash.utils.logging import setup_logging
from tools.tiny_data import RECIPE_VERSION, RECIPES
from tools.tiny_run import RunOptions, Training, save_run

logger = logging.getLogger("glmflash.train_tiny")
CALIBRATION_STEPS = (5, 25)  # the steps between which a timed run measures its step time
# A timed run plans steps for this share of its remaining budget (the rest: checkpoints)...
PLAN_SHARE = 0.96
# ... and stops at the latest this much past its budget (slower steps than measured).
OVERRUN = 1.08


def train(out: Path, options: RunOptions, *, steps: int | None, minutes: float | None,
          checkpoint_minutes: float, tar: Path | None) -> dict:
    run = Training(options, total_steps=steps or 10**9)
    start = last_save = time.time()
    deadline = start + 60 * minutes if minutes else None
    try:
        while run.num_steps < run.total_steps:
            run.step()
            now = time.time()
            if run.num_steps == CALIBRATION_STEPS[1] and steps is None:
                run.total_steps = _steps_to_fill(run, deadline, now)
            if deadline and now > start + (deadline - start) * OVERRUN:
                logger.warning("time is up at step %d of %d", run.num_steps, run.total_steps)
                break
            if now - last_save > 60 * checkpoint_minutes and run.num_steps < run.total_steps:
                save_run(run, out, tar, complete=False)
                last_save = time.time()
        return save_run(run, out, tar, complete=True)
    finally:
        run.close()


def _steps_to_fill(run: Training, deadline: float, now: float) -> int:
    first, last = CALIBRATION_STEPS
    seconds_per_step = (run.step_times[last - 1] - run.step_times[first - 1]) / (last - first)
    total = run.num_steps + int(PLAN_SHARE * (deadline - now) / seconds_per_step)
    logger.info("%.3f s per step: %d steps fill the budget", seconds_per_step, total)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--steps", type=int, help="a fixed number of steps")
    budget.add_argument("--minutes", type=float, help="train for this long (steps fixed after "
                        "timing the first ones)")
    parser.add_argument("--tokens-per-step", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--amp", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: autocast on the device (the weights and optimizer stay fp32)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the mHC and MoE blocks (compile time counts)")
    parser.add_argument("--workers", type=int, default=None,
                        help="data worker processes (default: none on the CPU, up to 8 else)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of the training process (1 is fastest on a shared "
                        "machine)")
    parser.add_argument("--recipe", type=int, default=RECIPE_VERSION, choices=sorted(RECIPES),
                        help="the training data's recipe (tools/tiny_data.py RECIPES)")
    parser.add_argument("--graph", action="store_true",
                        help="batches of one planned shape (about --tokens-per-step tokens), "
                        "each step replayed as a CUDA graph")
    parser.add_argument("--qat-fraction", type=float, default=0.0,
                        help="train the last part of the steps through FP8-rounded weights")
    parser.add_argument("--checkpoint-minutes", type=float, default=1.5)
    parser.add_argument("--tar", type=Path, help="also write OUT_DIR as this tar file")
    parser.add_argument("--eval", action="store_true", help="evaluate the result (CPU fp32)")
    parser.add_argument("--gpu-check", action="store_true",
                        help="with --eval: greedy bf16 on the GPU against CPU fp32")
    args = parser.parse_args()
    if args.steps is None and args.minutes is None:
        args.steps = 560
    setup_logging()
    torch.set_num_threads(args.threads)
    workers = args.workers if args.workers is not None else \
        (0 if args.device == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2)))
    options = RunOptions(seed=args.seed, tokens_per_step=args.tokens_per_step, peak_lr=args.lr,
                         warmup_steps=args.warmup_steps, device=args.device, amp=args.amp,
                         compile=args.compile, workers=workers, threads=args.threads,
                         qat_fraction=args.qat_fraction, graph=args.graph,
                         recipe=args.recipe)
    training = train(args.out, options, steps=args.steps, minutes=args.minutes,
                     checkpoint_minutes=args.checkpoint_minutes, tar=args.tar)
    logger.info("wrote %s: %s", args.out, json.dumps(training))
    if args.eval:
        from tools.eval_tiny import record_eval

        torch.set_num_threads(os.cpu_count() or 1)
        record_eval(args.out, gpu_check=args.gpu_check, tar=args.tar)


if __name__ == "__main__":
    main()
