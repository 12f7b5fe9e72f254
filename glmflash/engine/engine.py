"""`glmflash.Engine`: one step = schedule, run, sample, update, emit; a loop thread drives it."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.engine.api import EngineApiMixin
from glmflash.engine.cache import CacheManager, CachePlan, PrefixCacheStats
from glmflash.engine.detokenizer import SequenceDetokenizer
from glmflash.engine.emit import EngineEmitMixin
from glmflash.engine.errors import EngineDead, EngineOverloaded, PromptTooLong
from glmflash.engine.loop import EngineLoopMixin
from glmflash.engine.memory_plan import measured_peak
from glmflash.engine.multimodal import MediaPreparer, MediaSources, collect_media, media_cache_key
from glmflash.engine.options import EngineConfig
from glmflash.engine.outputs import EngineStats, Result, StreamDelta
from glmflash.engine.progress import PrefillProgress
from glmflash.engine.sampler import Sampler
from glmflash.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from glmflash.engine.sequence import Sequence
from glmflash.engine.startup import WARMUP_TOKENS, EngineStartupMixin, resolve_dtype, warmup_text
from glmflash.engine.warmup import warm_up_kernels
from glmflash.multimodal.fetch import UrlPolicy
from glmflash.multimodal.prompt import MultimodalPrompt
from glmflash.sampling_params import SamplingParams, wrap_seed
from glmflash.tokenizer import Tokenizer
from glmflash.utils.logging import setup_logging
from glmflash.utils.preflight import UsageError, check_device
from glmflash.utils.validation import is_integer

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDead", "EngineOverloaded", "Result"]
Sink = Callable[[StreamDelta], None]


@dataclass
class _Choice:
    request_id: str
    index: int
    sink: Sink
    detok: SequenceDetokenizer
    seq: Sequence


class Engine(EngineApiMixin, EngineLoopMixin, EngineStartupMixin, EngineEmitMixin):
    """Loads a checkpoint (the embedded tiny one when `model_path` is None) and serves requests."""

    def __init__(self, model_path: str | Path | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, **options) -> None:
        log_level = options.pop("log_level", None)
        setup_logging(log_level)
        self.options = EngineConfig.from_options(options)
        if model_path is None:
            from glmflash.tiny.embedded import embedded_checkpoint
            model_path = embedded_checkpoint()
        self.model_path = Path(model_path)
        try:
            check_device(device)
        except UsageError as exc:  # the library's callers get a ValueError
            raise ValueError(str(exc).removeprefix("--device ")) from None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = ModelConfig.from_hf(self.model_path)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.max_seq_len = self.options.context_length or min(self.config.max_position_embeddings,
                                                              8192)
        if self.max_seq_len > self.config.max_position_embeddings:
            # No rotary positions (MLA without rope, KDA): longer runs, past the trained length.
            logger.warning("context length %d is past the model's max_position_embeddings %d",
                           self.max_seq_len, self.config.max_position_embeddings)
        warmup_ids = self.tokenizer.encode(warmup_text())[:WARMUP_TOKENS] \
            if self.options.kt_expert_placement == "frequency" else None
        self.runner, plan = self._start_runner(log_level, warmup_ids)
        try:  # the runner owns processes and memory (ranks of a split model): closed on failure
            self._build_around(plan)
            if not self.options.skip_kernel_warmup:
                with measured_peak(self.memory_ledger, "activations and workspaces",
                                   self.device, "warming up the kernels"):
                    warm_up_kernels(self)
            self._capture_graphs()
        except BaseException:
            self.runner.close()
            raise
        if self.memory_ledger is not None and self.device.type == "cuda":
            logger.info("after warm-up and graph capture: %s", self.memory_ledger.table())
        self._choices: dict[int, _Choice] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._live_requests: dict[str, int] = {}
        """Request id -> its choices not yet finished (under `_lock`): an id names one request."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        """Held by `step`: callers that drive the engine themselves (no engine thread) may do so
        from several threads, one step at a time."""
        self._stopping = False
        self._batch: ScheduledBatch | None = None
        self.fatal_error: str | None = None
        """Why the engine thread stopped (a device failure or an error the loop cannot survive)."""
        self.num_pending = 0
        self._publish_stats()
        logger.info("engine ready: %s on %s (%s), context %d", self.model_path, self.device,
                    self.dtype, self.max_seq_len)

    def _build_around(self, plan: CachePlan) -> None:
        """The cache, scheduler, sampler, drafting and media preparation over the runner."""
        self.cache = CacheManager(plan, use_prefix_cache=not self.options.disable_radix_cache)
        self.eos_token_ids = frozenset(self.config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self.scheduler = Scheduler(
            SchedulerConfig(self.options.max_running_requests, self.options.chunked_prefill_size,
                            self.max_seq_len), self.cache, self.eos_token_ids)
        self.progress = PrefillProgress(self.options.chunked_prefill_size)
        self.sampler = Sampler(self.options.seed, sleep_while_waiting=self.device.type == "cuda"
                               and self.options.kt_num_gpu_experts is not None)
        self.spec = self._speculative_decoder()
        self.media = MediaPreparer(self.config, self.tokenizer,
                                   limits=self.options.limit_mm_data_per_request,
                                   process=self.options.mm_process_config,
                                   local_root=self.options.media_local_root,
                                   url_policy=UrlPolicy.create(
                                       self.options.allowed_media_domains,
                                       self.options.allow_private_media_urls))

    # Submission, from any thread.
    def add_request(self, prompt_token_ids: list[int],
                    params: SamplingParams | Callable[[list[int]], SamplingParams], sink: Sink,
                    *, request_id: str | None = None, n: int = 1,
                    media: MediaSources | None = None) -> str:
        """Queue a request of `n` choices; `sink` receives its StreamDeltas on the engine thread.

        `media` (the images or video of a chat prompt) are fetched, checked and preprocessed
        here, on the caller's thread (blocking: never the engine thread's time), and the
        prompt's placeholders expanded; the model embeds them on the engine thread before the
        first prefill. `params` may be a function of the final prompt (an output budget that
        counts the media tokens). Raises MediaError (a ValueError) for bad media.
        """
        if not is_integer(n) or n < 1:
            raise ValueError(f"n must be an integer of at least 1, got {n!r}")
        mm = self.media.prepare(prompt_token_ids, media) if media else None
        if mm is not None:
            prompt_token_ids = mm.token_ids
        if self.failure is not None:
            raise EngineDead(f"the engine has stopped: {self.failure}")
        if callable(params):
            params = params(prompt_token_ids)
        self._validate_prompt(prompt_token_ids)
        request_id = self._claim_request_id(request_id or None, n)
        seqs = []
        for index in range(n):
            choice_params = params if params.seed is None or index == 0 else \
                _with_seed(params, wrap_seed(params.seed + index))
            seq = Sequence(next(self._seq_ids), prompt_token_ids, choice_params)
            self._choices[seq.seq_id] = _Choice(request_id, index, sink,
                                                SequenceDetokenizer(self.tokenizer, seq), seq)
            seqs.append(seq)
        self._inbox.put(("add", (seqs, mm)))
        if self.options.background_loop:
            self._ensure_thread()
        return request_id

    def _claim_request_id(self, request_id: str | None, n: int) -> str:
        """`request_id` (refused while a request of that id is unfinished: an abort would end
        both), or a fresh one; its n choices counted as pending, refused (EngineOverloaded)
        where they would take the choices in flight past `max_queued_requests`."""
        limit = self.options.max_queued_requests
        with self._lock:  # one check and count for concurrent submitters
            if limit is not None and self.num_pending + n > limit:
                raise EngineOverloaded("the engine is overloaded; try again later")
            if request_id is None:
                request_id = f"req-{next(self._request_ids)}"
                while request_id in self._live_requests:
                    request_id = f"req-{next(self._request_ids)}"
            elif request_id in self._live_requests:
                raise ValueError(f"request id {request_id!r} is in use by an unfinished request")
            self._live_requests[request_id] = n
            self.num_pending += n
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request at any moment; its pages and slots are freed on the engine thread."""
        self._inbox.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.runner.close()

    @property
    def supports_media(self) -> bool:
        """Images and video are accepted: the checkpoint has a vision tower."""
        return self.config.vision is not None

    @property
    def failure(self) -> str | None:
        """Why the engine cannot serve any more (its thread died), or None while it can."""
        thread = self._thread
        if self.fatal_error is None and thread is not None and not thread.is_alive() \
                and not self._stopping:
            return "the engine thread exited unexpectedly"
        return self.fatal_error

    def step(self) -> None:
        """Take in submissions and aborts, then run one scheduled batch (if any); callers on
        several threads take turns."""
        with self._step_lock:
            self._drain_inbox(block=False)
            self._batch = batch = self.scheduler.schedule()
            if batch is not None:
                self._run(batch)
            self._publish_stats()

    def _run(self, batch: ScheduledBatch) -> None:
        start = time.perf_counter()
        sampled = [s for s, need in zip(batch.seqs, batch.needs_sample, strict=True) if need]
        # Read before the step changes it: the speed check compares steps of decodes only.
        decodes_only = self.spec is not None and all(
            s.num_computed_tokens >= s.num_prompt_tokens for s in batch.seqs)
        speculative = self.spec is not None and self.spec.wants(batch)
        if speculative:
            runs = self.spec.verify(batch, sampled)
        else:
            logits = self.spec.run_plain(batch) if self.spec is not None else self.runner.run(batch)
            runs = [[t] for t in self.sampler.sample(logits, sampled)]
        self.runner.check_graph_experts()
        deltas = self.scheduler.update_runs(batch, self._end_failed_rows(sampled, runs))
        if self.spec is not None:
            self.spec.after_update(deltas)
            if decodes_only:
                self.spec.observe_speed(batch, speculative, sum(map(len, runs)),
                                        time.perf_counter() - start)
        self.progress.observe(batch, start, self._request_name)
        self._emit(deltas)
        self._batch = None
        if self.options.check_integrity:
            self.cache.check_integrity()

    def stats(self) -> EngineStats:
        """The load at the end of the latest step (from any thread: a published snapshot)."""
        return self._stats

    def _publish_stats(self) -> None:
        """Called by whichever thread drives the steps, the only one that changes this state."""
        self._stats = EngineStats(len(self.scheduler.waiting), len(self.scheduler.running),
                                  self.cache.num_free_pages, self.cache.plan.num_pages,
                                  self.cache_stats(),
                                  self.spec.stats() if self.spec is not None else None)

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters, now (the engine thread; other threads read `stats()`)."""
        return self.cache.stats(self.scheduler.num_query_tokens, self.scheduler.num_hit_tokens)

    def _request_name(self, seq: Sequence) -> str:
        choice = self._choices.get(seq.seq_id)
        return str(seq.seq_id) if choice is None else f"{choice.request_id}/{choice.index}"

    def _end_failed_rows(self, seqs: list[Sequence], token_ids: list) -> list:
        """End the sequences whose logits processor raised; the other rows' ids, in order.

        NOTE: Scheduler.update skips a finished sequence without taking an id.
        """
        errors = self.sampler.errors
        for row, error in errors.items():
            seq, choice = seqs[row], self._choices[seqs[row].seq_id]
            logger.warning("request %s: logits processor failed: %s", choice.request_id, error)
            self.scheduler.finish(seq, "error")
            self._finish(seq, choice, StreamDelta(choice.request_id, choice.index, "", [],
                                                  "error", error=error))
        return [t for row, t in enumerate(token_ids) if row not in errors]

    def _admit(self, seqs: list[Sequence], mm: MultimodalPrompt | None) -> None:
        # Choices ended while their request waited in the inbox (a step that failed before it
        # had a batch ends every live choice) stay ended.
        seqs = [seq for seq in seqs if seq.seq_id in self._choices]
        if not seqs:
            return
        if mm is not None:
            try:
                with torch.inference_mode():
                    embeds = self.runner.model.embed_multimodal(mm.token_ids, mm.image_inputs,
                                                                mm.video_inputs)
            except Exception as exc:  # bad media ends this request only
                logger.exception("vision features failed")
                for seq in seqs:
                    choice = self._choices[seq.seq_id]
                    seq.finish("error")
                    self._finish(seq, choice, StreamDelta(choice.request_id, choice.index, "",
                                                          [], "error", error=str(exc)))
                return
            key = media_cache_key(mm.token_ids, embeds, self.config.image_token_id)
            for seq in seqs:
                seq.prompt_embeds, seq.media_key = embeds, key
        for seq in seqs:
            self.runner.prompt_logprobs.admit(seq)
            self.scheduler.add(seq)

    def prepare_multimodal(self, token_ids: list[int],
                           messages: list[dict]) -> MultimodalPrompt | None:
        """What `add_request(media=...)` makes of a chat prompt's media (the expanded prompt and
        pixels), for inspection; None for a text-only request. Raises MediaError."""
        sources = collect_media(messages)
        return self.media.prepare(token_ids, sources) if sources else None

    def _abort(self, request_id: str) -> None:
        for seq_id, choice in list(self._choices.items()):
            if choice.request_id == request_id:
                seq = self.scheduler.abort(seq_id)
                if seq is not None:
                    self._finish(seq, choice, StreamDelta(request_id, choice.index, "", [],
                                                          "abort"))

    def _live_seqs(self) -> list[Sequence]:
        """Every sequence with an unfinished choice: queued, running or still in the inbox."""
        return [choice.seq for choice in list(self._choices.values())]

    def _fail_seqs(self, seqs: list[Sequence], error: str) -> None:
        """End `seqs` with an error delta and give their pages and state slots back."""
        for seq in seqs:
            choice = self._choices.get(seq.seq_id)
            if choice is None:
                continue
            self.scheduler.abort(seq.seq_id)
            self.cache.free(seq)
            seq.finish("error")
            self._finish(seq, choice, StreamDelta(choice.request_id, choice.index, "", [],
                                                  "error", error=error))

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        if any(not 0 <= t < self.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if len(token_ids) >= self.max_seq_len:
            raise PromptTooLong(len(token_ids), self.max_seq_len)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
