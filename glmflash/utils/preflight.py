"""Checks of what the user asked for, made before anything slow (the model load), and the one
way the commands report a failure: one line on stderr, the traceback only with --debug."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("glmflash.cli")

# Exit statuses: a user error (argparse's own), anything else, Ctrl-C.
EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 2, 1, 130
DEVICE_TYPES = ("cpu", "cuda")


class UsageError(Exception):
    """A mistake in what the user asked for; the message says what is wrong and what to do."""


def run_reporting_errors(main: Callable[[], int], *, debug: bool = False,
                         usage_errors: tuple[type[Exception], ...] = ()) -> int:
    """Run a command: user errors (these, plus `usage_errors`, e.g. the engine's start-up
    errors) are one line (status 2), other failures one line saying how to see the traceback
    (status 1); `debug` logs the traceback as well."""
    try:
        return main()
    except (UsageError, ValueError, TypeError, OSError, *usage_errors) as exc:
        logger.error("%s", exc, exc_info=debug)
        return EXIT_USAGE
    except KeyboardInterrupt:
        logger.error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as exc:
        hint = "" if debug else " (run again with --debug for the traceback)"
        logger.error("internal error: %s: %s%s", type(exc).__name__, exc, hint, exc_info=debug)
        return EXIT_INTERNAL


def check_device(device: str | None) -> None:
    """`--device` names a device type this build runs on, and one that is present."""
    if device is None:
        return
    import torch

    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device}: unknown device; use cpu or cuda") from None
    if parsed.type not in DEVICE_TYPES:
        raise UsageError(f"--device {device}: not supported by glmflash; use cpu or cuda")
    if parsed.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "no GPU or driver found"
        raise UsageError(f"--device {device}: no CUDA device is visible (torch {torch.__version__}"
                         f", {build}); use --device cpu")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) "
                         "are visible")


def check_model_path(path: str | None) -> None:
    """`--model-path` is a checkpoint folder with a readable config.json and a tokenizer.json."""
    if path is None:
        return
    folder = Path(path).expanduser()
    if not folder.exists():
        raise UsageError(f"--model-path {path}: no such folder")
    if not folder.is_dir():
        raise UsageError(f"--model-path {path} is a file; pass the checkpoint folder (the one "
                         "holding config.json)")
    config = folder / "config.json"
    if not config.is_file():
        raise UsageError(f"--model-path {path}: no config.json in it; pass a Hugging Face "
                         "checkpoint folder")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{config} is not valid JSON ({exc}); restore it from the "
                         "checkpoint") from None
    if not (folder / "tokenizer.json").is_file():
        raise UsageError(f"{folder / 'tokenizer.json'} is missing; copy the checkpoint's "
                         "tokenizer files into the folder")


def max_cpu_threads() -> int:
    """The most threads the CPU expert kernel can run: numba's limit (NUMBA_NUM_THREADS, by
    default the CPUs this process may use)."""
    try:
        import numba
    except ImportError:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count() or 1
    return int(numba.config.NUMBA_NUM_THREADS)


def clamp_cpu_threads(requested: int | None, flag: str) -> int | None:
    """`requested` threads, or the most available with a warning when it asks for more."""
    limit = max_cpu_threads()
    if requested is None or requested <= limit:
        return requested
    logger.warning("%s %d: this machine gives the process %d CPU threads; using %d", flag,
                   requested, limit, limit)
    return limit

