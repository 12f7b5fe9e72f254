"""The server's command line (`glmflash serve` and `python -m glmflash.launch_server`), built by
one function, `add_server_args`. Flags keep the names of the seed's launch command; those that
do not apply on this machine or build are accepted and reported at start-up (one line each)."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from glmflash.engine.options import LOAD_FORMATS
from glmflash.utils.cli_args import ArgumentParser, HelpFormatter, non_negative_float

DEFAULT_PORT = 30000
# Past this, 413 (a 24 MiB image fits as base64; larger media come by URL). JSON parsing holds
# the GIL: 32 MiB of text parses in about 0.1 s.
DEFAULT_MAX_REQUEST_BYTES = 32 << 20
DEFAULT_GRACEFUL_TIMEOUT_S = 30.0
_GPU_EXPERT_FLAGS = ("kt_num_gpu_experts", "kt_gpu_prefill_token_threshold",
                     "kt_expert_placement")
_MEDIA_FLAGS = ("limit_mm_data_per_request", "mm_process_config", "media_local_root",
                "allowed_media_domains", "allow_private_media_urls")
# Flags passed to Engine(**options) under their own names (EngineConfig fields).
_ENGINE_OPTIONS = ("context_length", "max_running_requests", "chunked_prefill_size",
                   "mem_fraction_static", "cache_budget_gb", "max_queued_requests", "seed",
                   "page_size", "kt_method", "kt_num_gpu_experts", "kt_gpu_prefill_token_threshold",
                   "kt_cpuinfer", "kt_threadpool_count", "kt_expert_placement", "load_format",
                   "skip_kernel_warmup", "cuda_graph_bs", "cuda_graph_max_bs",
                   "disable_cuda_graph", "ep_size", "disable_radix_cache", "max_state_snapshots",
                   *_MEDIA_FLAGS)
# chunked prefill off (SGLang's -1): one chunk as large as any prompt.
_UNCHUNKED = 2**31 - 1


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _chunk_size(text: str) -> int:
    value = _int(text)
    if value == -1 or value == 0:
        return _UNCHUNKED
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or -1 for no chunking), got {value}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_server_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Every server flag (the one place the server CLI is defined)."""
    from glmflash import __version__

    parser.add_argument("--version", action="version", version=f"glmflash {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of a start-up error")
    model = parser.add_argument_group("model")
    model.add_argument("--model-path", default=None,
                       help="checkpoint folder (default: the embedded tiny checkpoint)")
    model.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="model name(s) clients use (default: the model path, or "
                            "glmflash-tiny for the embedded checkpoint)")
    model.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    model.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: by device)")
    model.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                       help="auto: read the checkpoint; dummy: seeded random weights made in "
                            "memory (benchmarks; the folder needs only config and tokenizer)")
    model.add_argument("--tool-call-parser", default="glm47", choices=("glm47", "none"))
    model.add_argument("--reasoning-parser", default="glm45", choices=("glm45", "none"))
    model.add_argument("--skip-kernel-warmup", action="store_true", default=None,
                       help="do not compile and warm the GPU kernels at start (the first "
                            "requests pay for it)")

    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1")
    http.add_argument("--port", type=_positive_int, default=DEFAULT_PORT)
    http.add_argument("--api-key", default=None,
                      help="require `Authorization: Bearer KEY` on /v1 routes")
    http.add_argument("--log-level", default="info",
                      choices=("debug", "info", "warning", "error"))
    http.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                      metavar="BYTES", help="larger request bodies are refused (413)")
    http.add_argument("--graceful-shutdown-timeout", type=non_negative_float,
                      default=DEFAULT_GRACEFUL_TIMEOUT_S, metavar="SECONDS",
                      help="on SIGINT/SIGTERM, how long running requests may finish before they "
                           "are ended with an error")

    engine = parser.add_argument_group("engine")
    engine.add_argument("--context-length", type=_positive_int, default=None)
    engine.add_argument("--max-running-requests", type=_positive_int, default=None)
    engine.add_argument("--max-queued-requests", type=_positive_int, default=None,
                        help="choices in flight beyond this are answered 503 (default: no limit)")
    engine.add_argument("--chunked-prefill-size", type=_chunk_size, default=None,
                        help="most prompt tokens per step (-1: no chunking)")
    engine.add_argument("--page-size", type=_positive_int, default=None)
    engine.add_argument("--mem-fraction-static", type=_fraction, default=None,
                        help="GPU: fraction of device memory for weights plus cache")
    engine.add_argument("--cache-budget-gb", type=_positive_float, default=None,
                        help="CPU: GiB for the cache")
    engine.add_argument("--seed", type=int, default=None, help="default sampling seed")
    engine.add_argument("--disable-radix-cache", action="store_true", default=None,
                        help="turn the prefix cache off: every prompt is computed from its start")
    engine.add_argument("--max-state-snapshots", type=_non_negative_int, default=None,
                        metavar="N", help="prefix cache: KDA state snapshots kept, each as large "
                                          "as a sequence's state (default: twice "
                                          "--max-running-requests)")
    engine.add_argument("--tp-size", type=_positive_int, default=1,
                        help="ranks (one process per GPU) the model is split over")
    engine.add_argument("--ep-size", type=_positive_int, default=None,
                        help="1: routed experts split by width; --tp-size: experts divided "
                        "among the ranks")
    engine.add_argument("--cuda-graph-bs", type=_positive_int, nargs="+", default=None,
                        metavar="BS", help="decode batch sizes captured as CUDA graphs "
                        "(default 1 2 4 8 16 32)")
    engine.add_argument("--cuda-graph-max-bs", type=_positive_int, default=None,
                        help="largest decode batch replayed from a graph")
    engine.add_argument("--disable-cuda-graph", action="store_true", default=None,
                        help="decode without CUDA graphs")

    kt = parser.add_argument_group("routed experts on the CPU (GPU machines: hybrid)")
    kt.add_argument("--kt-weight-path", default=None,
                    help="accepted for compatibility; experts are read from --model-path")
    kt.add_argument("--kt-method", default=None, help="CPU expert format (only FP8)")
    kt.add_argument("--kt-cpuinfer", type=_positive_int, default=None,
                    help="threads of the CPU expert kernel (default: all cores)")
    kt.add_argument("--kt-threadpool-count", type=_positive_int, default=None)
    kt.add_argument("--kt-num-gpu-experts", type=_non_negative_int, default=None,
                    help="GPU: experts per layer resident on the GPU, the rest on the CPU")
    kt.add_argument("--kt-expert-placement", choices=("front", "frequency"), default=None,
                    help="resident GPU experts: the first N, or the most routed over a warm-up "
                         "prompt at start")
    kt.add_argument("--kt-gpu-prefill-token-threshold", type=_positive_int, default=None,
                    help="GPU: prefill chunks this long stream each layer's experts to the GPU")

    media = parser.add_argument_group("images and video")
    media.add_argument("--limit-mm-data-per-request", type=_json_object, default=None,
                       metavar="JSON", help='e.g. \'{"image": 4, "video": 1}\'')
    media.add_argument("--mm-process-config", type=_json_object, default=None, metavar="JSON",
                       help='e.g. \'{"image": {"max_pixels": 1003520}}\'')
    media.add_argument("--media-local-root", default=None, metavar="DIR",
                       help="allow local image/video paths under DIR (default: refused)")
    media.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="fetch http(s) media only from these hosts (default: any public "
                            "host)")
    media.add_argument("--allow-private-media-urls", action="store_true", default=None,
                       help="let media URLs reach loopback, private and link-local addresses "
                            "(default: refused; trusted networks only)")
    _document_defaults(parser)
    return parser


def _document_defaults(parser: argparse.ArgumentParser) -> None:
    """--help names every default: the flag's own, or the engine's for flags left unset."""
    from dataclasses import MISSING, fields

    from glmflash.engine.options import EngineConfig

    engine = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
    for action in parser._actions:
        if not action.option_strings or "default:" in (action.help or ""):
            continue
        if action.default is None and engine.get(action.dest) is not None:
            action.help = f"{action.help or ''} (engine default: {engine[action.dest]})".lstrip()
        elif action.help is None and action.default not in (None, False):
            action.help = "(default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m glmflash.launch_server",
                            description="OpenAI-compatible GLM-5.3-Flash server",
                            formatter_class=HelpFormatter, allow_abbrev=False)
    return add_server_args(parser)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine(**options) keyword arguments from the flags (unset flags keep engine defaults)."""
    options = {name: getattr(args, name) for name in _ENGINE_OPTIONS
               if getattr(args, name) is not None}
    if _tp_applies(args):
        options["tp_size"] = args.tp_size
    elif "ep_size" in options:
        del options["ep_size"]
    if _too_few_threads_for_pools(args):
        # reported by inapplicable_flags; the engine would refuse the pair
        del options["kt_threadpool_count"]
    return options


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _tp_applies(args: argparse.Namespace) -> bool:
    """--tp-size > 1 splits the model over CPU processes with --device cpu, else over GPUs when
    enough are visible; the published four-GPU command on a smaller machine serves on one."""
    if args.tp_size == 1:
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
                       supports_media: bool) -> list[str]:
    """One line per flag that is accepted but has no effect here, saying why."""
    on_gpu = device_type == "cuda"
    reasons: dict[str, str] = {}
    if not on_gpu:
        reasons.update({dest: "CUDA graphs need a CUDA device" for dest in
                        ("cuda_graph_bs", "cuda_graph_max_bs") if getattr(args, dest)})
    if args.tp_size > 1 and args.device != "cpu" and num_gpus < args.tp_size:
        reasons["tp_size"] = f"only {num_gpus} CUDA device(s) visible; serving on one device " \
            "(--device cpu splits the model over CPU processes)"
        if args.ep_size is not None:
            reasons["ep_size"] = "no expert parallelism on one device"
    reasons.update(_expert_reasons(args, device_type))
    if not supports_media:
        reasons.update({dest: "this build has no image or video input" for dest in _MEDIA_FLAGS
                        if getattr(args, dest) is not None})
    if on_gpu and args.cache_budget_gb is not None:
        reasons["cache_budget_gb"] = "on cuda the cache size comes from --mem-fraction-static"
    if not on_gpu and args.mem_fraction_static is not None:
        reasons["mem_fraction_static"] = f"on {device_type} the cache size comes from " \
            "--cache-budget-gb"
    return [f"{_shown(args, dest)}: ignored: {why}" for dest, why in reasons.items()]


def _expert_reasons(args: argparse.Namespace, device_type: str) -> dict[str, str]:
    on_gpu = device_type == "cuda"
    reasons: dict[str, str] = {}
    if args.kt_weight_path is not None:
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
    if _too_few_threads_for_pools(args) and "kt_threadpool_count" not in reasons:
        reasons["kt_threadpool_count"] = f"--kt-cpuinfer {args.kt_cpuinfer} gives fewer " \
            "threads than pools (each pool needs one); using one pool"
    return reasons
