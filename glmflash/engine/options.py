"""EngineConfig: every engine option, validated once (the CLI and server flags map onto it)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from glmflash.utils.preflight import max_cpu_threads
from glmflash.utils.validation import require

LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class EngineConfig:
    context_length: int | None = None
    """Longest sequence (prompt + output); default min(model maximum, 8192)."""
    max_running_requests: int = 16
    chunked_prefill_size: int = 2048
    page_size: int = 64
    mem_fraction_static: float = 0.85
    """GPU: fraction of device memory for weights plus cache."""
    cache_budget_gb: float = 2.0
    """CPU: bytes for the cache (MLA pages and per-sequence state slots)."""
    disable_radix_cache: bool = False
    """Turn the prefix cache off (SGLang's flag): every prompt is computed from its start."""
    max_state_snapshots: int | None = None
    """Prefix cache: state snapshots kept (each as large as a sequence's state slot); default
    twice max_running_requests."""
    max_queued_requests: int | None = None
    """Choices in flight (queued or running) beyond this are refused (the server answers 503)."""
    seed: int | None = None
    limit_mm_data_per_request: dict | None = None
    """`{"image": 8, "video": 1}`: media per request (images and a video never together)."""
    mm_process_config: dict | None = None
    """`{"image": {"max_pixels": ...}, "video": {"fps": ..., "max_frames": ...}}`."""
    media_local_root: str | None = None
    """Local image/video paths are read only under this folder (None: refused)."""
    allowed_media_domains: tuple[str, ...] | None = None
    """http(s) media only from these hosts (None: any public host)."""
    allow_private_media_urls: bool = False
    """Let media URLs reach loopback, private and link-local addresses (trusted networks)."""
    kt_method: str = "FP8"
    """CPU expert format: FP8 (the checkpoint's own), the only one that honours swiglu_limit."""
    kt_num_gpu_experts: int | None = None
    """GPU machine: experts per layer resident on the GPU, the rest on the CPU (None: all GPU)."""
    kt_expert_placement: str = "front"
    """Which experts are resident: "front" (the first N) or "frequency" (most routed over a
    warm-up prompt at start)."""
    kt_gpu_prefill_token_threshold: int | None = None
    """Hybrid mode: prefill chunks of at least this many tokens stream experts to the GPU."""
    kt_cpuinfer: int | None = None
    """Threads of the CPU expert kernel (default: numba's, i.e. all cores)."""
    kt_threadpool_count: int = 1
    """Thread pools of the CPU expert kernel (one per NUMA node), each owning a slice of every
    expert; needs at least as many threads."""
    tp_size: int = 1
    """Ranks (one process per GPU, or per CPU share): attention heads and FFN widths divided
    among them; rank 0 (this process) owns the scheduler and starts the others."""
    ep_size: int = 1
    """1: routed experts split by width over the tp_size ranks; tp_size: experts divided
    among the ranks (expert parallel). With kt_num_gpu_experts they all live on rank 0."""
    load_format: str = "auto"
    """Where weights come from: "auto" reads the checkpoint's safetensors; "dummy" makes seeded
    random weights in memory (benchmarks at release shapes: the folder needs only config.json and
    the tokenizer files)."""
    cuda_graph_bs: tuple[int, ...] | None = None
    """Decode batch sizes captured as CUDA graphs (default 1, 2, 4, 8, 16, 32, capped by
    `cuda_graph_max_bs` and `max_running_requests`)."""
    cuda_graph_max_bs: int | None = None
    """The largest decode batch replayed from a graph; larger ones run eagerly."""
    disable_cuda_graph: bool = False
    """Run every decode step eagerly (no capture at start-up)."""
    skip_kernel_warmup: bool = False
    """Do not run the start-up forwards that compile and warm the model's kernels."""
    background_loop: bool = True
    """Drive steps from an engine thread; False: the caller drives `step()` (tests, offline)."""
    check_integrity: bool = False
    """Debug: verify cache ownership after every step."""

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
            (self.kt_expert_placement in ("front", "frequency"),
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
        ]
        require(checks)
        if self.kt_cpuinfer is not None:
            limit = max_cpu_threads()
            require([(self.kt_cpuinfer <= limit, f"kt_cpuinfer ({self.kt_cpuinfer}) is more than "
                      f"the {limit} CPU threads this process can use")])

    @classmethod
    def from_options(cls, options: dict) -> EngineConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown Engine options {unknown}; known: {sorted(known)}")
        values = {k: v for k, v in options.items() if v is not None}
        if values.get("cuda_graph_bs") is not None:
            values["cuda_graph_bs"] = tuple(values["cuda_graph_bs"])
        return cls(**values)
