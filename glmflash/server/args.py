"""The server's command line (`glmflash serve` and `python -m glmflash.launch_server`), built by
one function, `add_server_args`. Flags keep the names of the seed's launch command; those that
do not apply on this machine or build are accepted and reported at start-up (one line each)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from glmflash.engine.options import CPU_EXPERTS, ENGINE, MEDIA, MODEL, engine_flags
from glmflash.utils.cli_args import (
    ArgumentParser,
    HelpFormatter,
    non_negative_float,
    port,
    positive_int,
    secret,
)

DEFAULT_PORT = 30000
# Past this, 413 (a 24 MiB image fits as base64; larger media come by URL). JSON parsing holds
# the GIL: 32 MiB of text parses in about 0.1 s.
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_GRACEFUL_TIMEOUT_S = 30.0
_GPU_EXPERT_FLAGS = ("kt_num_gpu_experts", "kt_gpu_prefill_token_threshold",
                     "kt_expert_placement")
_MEDIA_FLAGS = tuple(name for name, _, flag in engine_flags() if flag.group == MEDIA)


def add_model_args(group: argparse._ArgumentGroup) -> None:
    """Where the model comes from and where it runs (both commands)."""
    group.add_argument("--model-path", default=None,
                       help="checkpoint folder (default: the embedded tiny checkpoint)")
    group.add_argument("--device", default=None,
                       help="cpu or cuda (default: cuda if available)")
    group.add_argument("--dtype", default=None,
                       help="float32 or bfloat16 (default: by device)")


def add_engine_args(parser: argparse.ArgumentParser,
                    groups: dict[str, argparse._ArgumentGroup]) -> None:
    """One flag per EngineConfig option (engine/options.py is the table), in its --help
    section (made here when `groups` lacks it). Every flag defaults to None: unset flags keep
    the engine's defaults, which --help names."""
    for name, default, flag in engine_flags():
        if flag.group not in groups:
            groups[flag.group] = parser.add_argument_group(flag.group)
        shown = "" if default in (None, False) or "default:" in flag.help \
            else f" (engine default: {default})"
        groups[flag.group].add_argument(f"--{name.replace('_', '-')}", default=None,
                                        help=f"{flag.help}{shown}", **flag.argparse)


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every server flag (the one place the server CLI is defined)."""
    from glmflash import __version__

    parser.add_argument("--version", action="version", version=f"glmflash {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a start-up error")
    model = parser.add_argument_group(MODEL)
    add_model_args(model)
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) clients use (default: the model path, or "
                            "glmflash-tiny for the embedded checkpoint)")
    model.add_argument("--tool-call-parser", default="glm47", choices=("glm47", "none"))
    model.add_argument("--reasoning-parser", default="glm45", choices=("glm45", "none"))

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=port, default=DEFAULT_PORT)
    http.add_argument("--api-key", type=secret, default=None, metavar="KEY",
                      help="require `Authorization: Bearer KEY` on /v1 routes")
    http.add_argument("--log-level", default="info",
                      choices=("debug", "info", "warning", "error"))
    http.add_argument("--max-request-bytes", type=positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                      metavar="BYTES", help="larger request bodies are refused (413)")
    http.add_argument("--graceful-shutdown-timeout", type=non_negative_float,
                      default=DEFAULT_GRACEFUL_TIMEOUT_S, metavar="SECONDS",
                      help="on SIGINT/SIGTERM, how long running requests may finish before they "
                           "are ended with an error")
    groups = {MODEL: model, ENGINE: parser.add_argument_group(ENGINE),
              CPU_EXPERTS: parser.add_argument_group(CPU_EXPERTS)}
    groups[CPU_EXPERTS].add_argument(
        "--kt-weight-path", default=None,
        help="accepted for compatibility; experts are read from --model-path")
    add_engine_args(parser, groups)
    _document_defaults(parser)
    return parser


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    """--help names the default of flags without a help text (argparse skips them)."""
    for action in parser._actions:
        if action.option_strings and action.help is None \
                and action.default not in (None, False):
            action.help = "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m glmflash.launch_server",
                            description="OpenAI-compatible GLM-5.3-Flash server",
                            formatter_class=HelpFormatter, allow_abbrev=False)
    return add_server_args(parser)


def engine_options(args: argparse.Namespace, *, for_server: bool = True) -> dict[str, Any]:
    """Engine(**options) keyword arguments from the flags (unset flags keep engine defaults).

    The server serves a published multi-GPU command on a smaller machine on one device, and
    drops a thread-pool count the thread count cannot feed (both reported by
    `inapplicable_flags`); `glmflash generate` passes every flag as given.
    """
    options = {name: getattr(args, name) for name, _, _ in engine_flags()
               if getattr(args, name) is not None}
    if not for_server:
        return options
    if not _tp_applies(args):
        options.pop("tp_size", None)
        options.pop("ep_size", None)
    if _too_few_threads_for_pools(args):
        del options["kt_threadpool_count"]
    return options


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tp_applies(args: argparse.Namespace) -> bool:
    """--tp-size > 1 splits the model over CPU processes with --device cpu, else over GPUs when
    enough are visible; the published four-GPU command on a smaller machine serves on one."""
    if (args.tp_size or 1) == 1:
        return False
    return args.device == "cpu" or _visible_gpus() >= args.tp_size


def _too_few_threads_for_pools(args: argparse.Namespace) -> bool:
    """--kt-cpuinfer below --kt-threadpool-count (the seed's command has 1 thread, 2 pools)."""
    return args.kt_cpuinfer is not None and (args.kt_threadpool_count or 1) > args.kt_cpuinfer


def _shown(args: argparse.Namespace, dest: str) -> str:
    value = getattr(args, dest)
    text = " ".join(map(str, value)) if isinstance(value, list) else \
        json.dumps(value) if isinstance(value, dict) else str(value)
    return f"--{dest.replace('_', '-')} {text}"


def inapplicable_flags(args: argparse.Namespace, device_type: str, num_gpus: int,
                       supports_media: bool, *, for_server: bool = True) -> list[str]:
    """One line per flag that is accepted but has no effect here, saying why.

    `for_server=False` (`glmflash generate`, whose flags reach the engine as given, see
    `engine_options`, and which lacks the server's own flags such as --kt-weight-path)
    leaves out what only the server drops.
    """
    on_gpu = device_type == "cuda"
    reasons: dict[str, str] = {}
    if not on_gpu:
        reasons.update({dest: "CUDA graphs need a CUDA device" for dest in
                        ("cuda_graph_bs", "cuda_graph_max_bs") if getattr(args, dest)})
    if for_server and (args.tp_size or 1) > 1 and args.device != "cpu" \
            and num_gpus < args.tp_size:
        reasons["tp_size"] = f"only {num_gpus} CUDA device(s) visible; serving on one device " \
            "(--device cpu splits the model over CPU processes)"
        if args.ep_size is not None:
            reasons["ep_size"] = "no expert parallelism on one device"
    elif on_gpu and args.kt_num_gpu_experts is not None and (args.ep_size or 1) > 1:
        reasons["ep_size"] = "with --kt-num-gpu-experts every routed expert lives on rank 0"
    reasons.update(_expert_reasons(args, device_type, for_server))
    if not supports_media:
        reasons.update({dest: "this build has no image or video input" for dest in _MEDIA_FLAGS
                        if getattr(args, dest) is not None})
    if on_gpu and args.cache_budget_gb is not None:
        reasons["cache_budget_gb"] = "on cuda the cache size comes from --mem-fraction-static"
    if not on_gpu and args.mem_fraction_static is not None:
        reasons["mem_fraction_static"] = f"on {device_type} the cache size comes from " \
            "--cache-budget-gb"
    return [f"{_shown(args, dest)}: ignored: {why}" for dest, why in reasons.items()]


def _expert_reasons(args: argparse.Namespace, device_type: str,
                    for_server: bool) -> dict[str, str]:
    on_gpu = device_type == "cuda"
    reasons: dict[str, str] = {}
    if getattr(args, "kt_weight_path", None) is not None:
        reasons["kt_weight_path"] = "experts are read from --model-path (FP8, as on disk)"
    if not on_gpu:
        reasons.update({dest: f"every expert runs on the {device_type}"
                        for dest in _GPU_EXPERT_FLAGS if getattr(args, dest) is not None})
    elif args.kt_num_gpu_experts is None:
        if args.kt_gpu_prefill_token_threshold is not None:
            reasons["kt_gpu_prefill_token_threshold"] = "layerwise prefill needs " \
                "--kt-num-gpu-experts (all experts are on the GPU)"
        reasons.update({dest: "no expert runs on the CPU without --kt-num-gpu-experts"
                        for dest in ("kt_cpuinfer", "kt_threadpool_count")
                        if getattr(args, dest) is not None})
    if for_server and _too_few_threads_for_pools(args) and "kt_threadpool_count" not in reasons:
        reasons["kt_threadpool_count"] = f"--kt-cpuinfer {args.kt_cpuinfer} gives fewer " \
            "threads than pools (each pool needs one); using one pool"
    return reasons
