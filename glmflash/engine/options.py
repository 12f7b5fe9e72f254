"""EngineConfig: every engine option, validated once. Its fields are the one flag table: each
`option(...)` row is both the Python keyword (`Engine(**options)`) and the command-line flag
(`--name-with-dashes`, built by `server/args.py` for `glmflash serve` and `glmflash generate`).

To add an option, add one field `name: type = option(default, "help", group, **argparse)` here
(plus its check in `__post_init__`); the flag, its --help line and its mapping follow.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from glmflash.utils.cli_args import (
    chunk_size,
    fraction,
    json_object,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from glmflash.utils.preflight import max_cpu_threads
from glmflash.utils.validation import require

LOAD_FORMATS = ("auto", "dummy")
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")
"""EAGLE is SGLang's name for the same thing here: chain drafts from the checkpoint's MTP layer."""
EXPERT_PLACEMENTS = ("front", "frequency")
INDEX_KEY_DTYPES = ("auto", "fp8")
INDEX_QUERY_DTYPES = ("auto", "fp8")
# --help sections of the flags.
MODEL, ENGINE, CPU_EXPERTS, MEDIA, SPECULATIVE = (
    "model", "engine", "routed experts on the CPU (GPU machines: hybrid)", "images and video",
    "speculative decoding (the checkpoint's MTP layer)")
FLAG = "flag"


@dataclass(frozen=True)
class Flag:
    """The command-line side of an option: its --help section and text, argparse extras."""

    group: str
    help: str
    argparse: dict[str, Any]


def option(default: Any, help: str, group: str | None = ENGINE, **argparse: Any) -> Any:
    """An EngineConfig field with a flag in `group` (None: Python only). Flags default to None
    in argparse, so an unset flag keeps the engine default (shown in --help)."""
    metadata = {} if group is None else {FLAG: Flag(group, help, argparse)}
    return field(default=default, metadata=metadata)


def engine_flags() -> list[tuple[str, Any, Flag]]:
    """(name, engine default, flag) of every option with a flag, in table order."""
    return [(f.name, f.default, f.metadata[FLAG]) for f in fields(EngineConfig)
            if FLAG in f.metadata]


@dataclass(frozen=True)
class EngineConfig:
    context_length: int | None = option(
        None, "longest sequence, prompt plus output (default: min(model maximum, 8192))",
        type=positive_int)
    max_running_requests: int = option(16, "sequences decoded together (state slots)",
                                       type=positive_int)
    chunked_prefill_size: int = option(2048, "most prompt tokens per step (-1: no chunking)",
                                       type=chunk_size)
    page_size: int = option(64, "tokens per cache page", type=positive_int)
    mem_fraction_static: float = option(
        0.85, "GPU: fraction of device memory for weights plus cache", type=fraction)
    cache_budget_gb: float = option(
        2.0, "CPU: GiB for the cache (MLA pages and per-sequence state slots)",
        type=positive_float)
    index_key_dtype: str = option(
        "auto", "the DSA indexer's pooled keys: auto (the model dtype, as the reference keeps "
        "them) or fp8 (e4m3 and a scale per key: half the bytes a long-context decode's "
        "indexer reads; a selection can differ from the reference's where pools score within "
        "e4m3 rounding of each other)", choices=INDEX_KEY_DTYPES)
    index_query_dtype: str = option(
        "auto", "the DSA indexer's queries: auto (the model dtype) or fp8 (each query head row "
        "as e4m3 with a scale, as the keys: needs --index-key-dtype fp8; faster long-context "
        "scoring, a selection can differ where pools score within e4m3 rounding)",
        choices=INDEX_QUERY_DTYPES)
    disable_radix_cache: bool = option(
        False, "turn the prefix cache off (every prompt is computed from its start)",
        action="store_true")
    max_state_snapshots: int | None = option(
        None, "prefix cache: KDA state snapshots kept, each as large as a sequence's state "
        "(default: twice --max-running-requests)", type=non_negative_int, metavar="N")
    max_queued_requests: int | None = option(
        None, "choices in flight (queued or running) beyond this are refused (the server "
        "answers 503; default: no limit)", type=positive_int)
    seed: int | None = option(None, "default sampling seed", type=int)
    limit_mm_data_per_request: dict | None = option(
        None, 'media per request, e.g. \'{"image": 8, "video": 1}\' (images and a video never '
        'together)', MEDIA, type=json_object, metavar="JSON")
    mm_process_config: dict | None = option(
        None, 'e.g. \'{"image": {"max_pixels": 1003520}, "video": {"fps": 2, "max_frames": '
        '32}}\'', MEDIA, type=json_object, metavar="JSON")
    media_local_root: str | None = option(
        None, "allow local image/video paths under DIR (default: refused)", MEDIA,
        metavar="DIR")
    allowed_media_domains: tuple[str, ...] | None = option(
        None, "fetch http(s) media only from these hosts (default: any public host)", MEDIA,
        nargs="+", metavar="HOST")
    allow_private_media_urls: bool = option(
        False, "let media URLs reach loopback, private and link-local addresses (trusted "
        "networks only)", MEDIA, action="store_true")
    kt_method: str = option(
        "FP8", "CPU expert format: FP8 (the checkpoint's own), the only one that honours "
        "swiglu_limit", CPU_EXPERTS)
    kt_num_gpu_experts: int | None = option(
        None, "GPU: experts per layer resident on the GPU, the rest on the CPU (default: all "
        "on the GPU)", CPU_EXPERTS, type=non_negative_int)
    kt_expert_placement: str = option(
        "front", "resident GPU experts: the first N, or the most routed over a warm-up prompt "
        "at start", CPU_EXPERTS, choices=EXPERT_PLACEMENTS)
    kt_gpu_prefill_token_threshold: int | None = option(
        None, "GPU: prefill chunks this long stream each layer's experts to the GPU",
        CPU_EXPERTS, type=positive_int)
    kt_cpuinfer: int | None = option(
        None, "threads of the CPU expert kernel (default: all cores)", CPU_EXPERTS,
        type=positive_int)
    kt_threadpool_count: int = option(
        1, "thread pools of the CPU expert kernel (one per NUMA node), each owning a slice of "
        "every expert; needs at least as many threads", CPU_EXPERTS, type=positive_int)
    tp_size: int = option(
        1, "ranks (one process per GPU, or per CPU share) the model is split over: attention "
        "heads and FFN widths; rank 0 owns the scheduler and starts the others",
        type=positive_int)
    ep_size: int = option(
        1, "1: routed experts split by width over the ranks; --tp-size: experts divided among "
        "the ranks (with --kt-num-gpu-experts they all live on rank 0)", type=positive_int)
    load_format: str = option(
        "auto", "auto: read the checkpoint's safetensors; dummy: seeded random weights made in "
        "memory (benchmarks at release shapes: the folder needs only config.json and the "
        "tokenizer)", MODEL, choices=LOAD_FORMATS)
    cuda_graph_bs: tuple[int, ...] | None = option(
        None, "decode batch sizes captured as CUDA graphs (default 1 2 4 8 16 32, capped by "
        "--cuda-graph-max-bs and --max-running-requests)", type=positive_int, nargs="+",
        metavar="BS")
    cuda_graph_max_bs: int | None = option(
        None, "the largest decode batch replayed from a graph; larger ones run eagerly",
        type=positive_int)
    disable_cuda_graph: bool = option(False, "run every decode step eagerly (no capture)",
                                      action="store_true")
    skip_kernel_warmup: bool = option(
        False, "do not compile and warm the kernels at start (the first requests pay for it)",
        MODEL, action="store_true")
    speculative_algorithm: str | None = option(
        None, "NEXTN (alias EAGLE): draft tokens with the checkpoint's MTP layer and verify them "
        "in one forward (default: off)", SPECULATIVE, choices=SPECULATIVE_ALGORITHMS,
        type=str.upper)
    speculative_num_steps: int | None = option(
        None, "draft tokens per step, chained (default 1)", SPECULATIVE, type=positive_int)
    speculative_eagle_topk: int | None = option(
        None, "drafts per step and position: only 1 (a chain)", SPECULATIVE, type=positive_int)
    speculative_num_draft_tokens: int | None = option(
        None, "tokens verified per sequence and step: --speculative-num-steps + 1", SPECULATIVE,
        type=positive_int)
    speculative_max_batch_size: int = option(
        8, "no drafts while more sequences than this decode together (verify steps stop "
        "paying once decode is compute-bound)", SPECULATIVE, type=positive_int)
    speculative_min_acceptance: float = option(
        0.2, "drafting pauses (and is retried later) while the measured acceptance of first "
        "drafts is below this (0: never)", SPECULATIVE, type=non_negative_float)
    disable_speculative_speed_check: bool = option(
        False, "keep drafting even when decode measures slower with drafts than without (by "
        "default drafting is held off for a while then)", SPECULATIVE, action="store_true")
    background_loop: bool = option(True, "", None)
    """Drive steps from an engine thread; False: the caller drives `step()` (tests, offline)."""
    check_integrity: bool = option(False, "", None)
    """Debug: verify cache ownership after every step."""

    @property
    def fp8_index_keys(self) -> bool:
        """The pooled indexer keys are FP8 rows (kernels/indexer/key_format.py)."""
        return self.index_key_dtype == "fp8"

    @property
    def fp8_index_queries(self) -> bool:
        """The indexer scores e4m3 query rows against the FP8 pooled keys."""
        return self.index_query_dtype == "fp8"

    @property
    def num_speculative_steps(self) -> int:
        """Draft tokens per sequence and step (0: speculative decoding is off)."""
        if self.speculative_algorithm is None:
            return 0
        if self.speculative_num_steps is not None:
            return self.speculative_num_steps
        if self.speculative_num_draft_tokens is not None:
            return self.speculative_num_draft_tokens - 1
        return 1

    @property
    def num_state_snapshots(self) -> int:
        if self.disable_radix_cache:
            return 0
        if self.max_state_snapshots is not None:
            return self.max_state_snapshots
        return 2 * self.max_running_requests

    def __post_init__(self) -> None:
        checks = [
            (self.context_length is None or self.context_length >= 2,
             "context_length must be >= 2"),
            (self.max_running_requests >= 1, "max_running_requests must be >= 1"),
            (self.chunked_prefill_size >= 1, "chunked_prefill_size must be >= 1"),
            (self.page_size >= 1, "page_size must be >= 1"),
            (self.max_state_snapshots is None or self.max_state_snapshots >= 0,
             "max_state_snapshots must be >= 0"),
            (0 < self.mem_fraction_static <= 1, "mem_fraction_static must be in (0, 1]"),
            (self.cache_budget_gb > 0, "cache_budget_gb must be > 0"),
            (self.kt_method.upper() == "FP8", f"kt_method {self.kt_method!r} is not supported "
             "(only FP8: other CPU formats ignore the SwiGLU clamp)"),
            (self.kt_expert_placement in EXPERT_PLACEMENTS,
             f"kt_expert_placement {self.kt_expert_placement!r} must be 'front' or 'frequency'"),
            (self.kt_num_gpu_experts is None or self.kt_num_gpu_experts >= 0,
             "kt_num_gpu_experts must be >= 0"),
            (self.kt_gpu_prefill_token_threshold is None
             or self.kt_gpu_prefill_token_threshold >= 1,
             "kt_gpu_prefill_token_threshold must be >= 1"),
            (self.kt_cpuinfer is None or self.kt_cpuinfer >= 1, "kt_cpuinfer must be >= 1"),
            (self.kt_threadpool_count >= 1, "kt_threadpool_count must be >= 1"),
            (self.kt_cpuinfer is None or self.kt_cpuinfer >= self.kt_threadpool_count,
             f"kt_cpuinfer ({self.kt_cpuinfer}) must be >= kt_threadpool_count "
             f"({self.kt_threadpool_count}): every pool needs a thread"),
            (self.cuda_graph_bs is None or all(b >= 1 for b in self.cuda_graph_bs),
             "cuda_graph_bs sizes must be >= 1"),
            (self.cuda_graph_max_bs is None or self.cuda_graph_max_bs >= 1,
             "cuda_graph_max_bs must be >= 1"),
            (self.tp_size >= 1, "tp_size must be >= 1"),
            (self.ep_size in (1, self.tp_size),
             f"ep_size ({self.ep_size}) must be 1 or tp_size ({self.tp_size})"),
            (self.tp_size == 1 or self.kt_expert_placement == "front",
             "kt_expert_placement 'frequency' needs tp_size 1 (its warm-up runs on one rank)"),
            (self.load_format in LOAD_FORMATS,
             f"load_format {self.load_format!r} must be one of {LOAD_FORMATS}"),
            (self.index_key_dtype in INDEX_KEY_DTYPES,
             f"index_key_dtype {self.index_key_dtype!r} must be one of {INDEX_KEY_DTYPES}"),
            (self.index_query_dtype in INDEX_QUERY_DTYPES,
             f"index_query_dtype {self.index_query_dtype!r} must be one of "
             f"{INDEX_QUERY_DTYPES}"),
            (not self.fp8_index_queries or self.fp8_index_keys,
             f"index_query_dtype 'fp8' needs index_key_dtype 'fp8' (not "
             f"{self.index_key_dtype!r}): e4m3 queries are scored against FP8 pooled keys"),
        ]
        require(checks)
        self._check_speculative()
        if self.kt_cpuinfer is not None:
            limit = max_cpu_threads()
            require([(self.kt_cpuinfer <= limit, f"kt_cpuinfer ({self.kt_cpuinfer}) is more than "
                      f"the {limit} CPU threads this process can use")])

    def _check_speculative(self) -> None:
        algorithm, steps = self.speculative_algorithm, self.speculative_num_steps
        # Options of speculative decoding given without it (the policy's: set off their
        # defaults), which would have no effect.
        defaults = {f.name: f.default for f in fields(self)}
        given = [n for n in ("speculative_num_steps", "speculative_eagle_topk",
                             "speculative_num_draft_tokens", "speculative_max_batch_size",
                             "speculative_min_acceptance", "disable_speculative_speed_check")
                 if getattr(self, n) != defaults[n]]
        draft_tokens = self.speculative_num_draft_tokens
        require([
            (algorithm is not None or not given,
             f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} "
             "speculative_algorithm (NEXTN)"),
            (algorithm is None or algorithm.upper() in SPECULATIVE_ALGORITHMS,
             f"speculative_algorithm {algorithm!r} must be one of {SPECULATIVE_ALGORITHMS}"),
            (steps is None or steps >= 1, "speculative_num_steps must be >= 1"),
            (self.speculative_eagle_topk in (None, 1),
             "speculative_eagle_topk must be 1 (drafts are a chain, no tree)"),
            (draft_tokens is None or draft_tokens >= 2,
             "speculative_num_draft_tokens must be >= 2"),
            (draft_tokens is None or steps is None or draft_tokens == steps + 1,
             f"speculative_num_draft_tokens ({draft_tokens}) must be speculative_num_steps + 1 "
             f"({steps} + 1) with a chain of drafts"),
            (algorithm is None or self.tp_size == 1,
             "speculative decoding needs tp_size 1 (the ranks of a split model do not draft)"),
            (0 <= self.speculative_min_acceptance <= 1,
             "speculative_min_acceptance must be in [0, 1]"),
            (self.speculative_max_batch_size >= 1, "speculative_max_batch_size must be >= 1"),
        ])

    @classmethod
    def from_options(cls, options: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown Engine options {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in options.items() if v is not None}
        if values.get("speculative_algorithm") is not None:
            values["speculative_algorithm"] = values["speculative_algorithm"].upper()
        if values.get("cuda_graph_bs") is not None:
            values["cuda_graph_bs"] = tuple(values["cuda_graph_bs"])
        return cls(**values)
