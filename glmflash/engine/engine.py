"""`glmflash.Engine`: one step = schedule, run, sample, update, emit; a loop thread drives it."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.engine.api import EngineApiMixin
from glmflash.engine.cache import CacheManager, PrefixCacheStats
from glmflash.engine.cuda_graph import (
    decode_graph_sizes,
    graphs_unsupported,
    spec_graph_sizes,
)
from glmflash.engine.detokenizer import SequenceDetokenizer
from glmflash.engine.errors import EngineDead, EngineOverloaded, PromptTooLong
from glmflash.engine.loop import EngineLoopMixin
from glmflash.engine.memory_plan import measured_peak, plan_memory
from glmflash.engine.model_runner import ModelRunner, load_model
from glmflash.engine.multimodal import MediaPreparer, MediaSources, collect_media, media_cache_key
from glmflash.engine.options import EngineConfig
from glmflash.engine.outputs import EngineStats, Result, StreamDelta
from glmflash.engine.progress import PrefillProgress
from glmflash.engine.sampler import Sampler
from glmflash.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig, TokenDelta
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_policy import DraftPolicy
from glmflash.engine.spec_runner import SpecRunner, load_mtp_module
from glmflash.engine.speculative import SpecDecoder
from glmflash.engine.warmup import warm_up_kernels
from glmflash.model.mtp import with_mtp_layer
from glmflash.multimodal.fetch import UrlPolicy
from glmflash.multimodal.prompt import MultimodalPrompt
from glmflash.sampling_params import SamplingParams, wrap_seed
from glmflash.tokenizer import Tokenizer
from glmflash.utils.logging import setup_logging

logger = logging.getLogger(__name__)

__all__ = ["Engine", "EngineDead", "EngineOverloaded", "Result"]
WARMUP_TOKENS = 1024
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
Sink = Callable[[StreamDelta], None]


@dataclass
class _Choice:
    request_id: str
    index: int
    sink: Sink
    detok: SequenceDetokenizer
    seq: Sequence


class Engine(EngineApiMixin, EngineLoopMixin):
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
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = ModelConfig.from_hf(self.model_path)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.max_seq_len = self.options.context_length or min(self.config.max_position_embeddings,
                                                              8192)
        warmup_ids = self.tokenizer.encode(warmup_text())[:WARMUP_TOKENS] \
            if self.options.kt_expert_placement == "frequency" else None
        self.runner, plan = self._start_runner(log_level, warmup_ids)
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
        try:
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
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False
        self._batch: ScheduledBatch | None = None
        self.fatal_error: str | None = None
        """Why the engine thread stopped (a device failure or an error the loop cannot survive)."""
        self.num_pending = 0
        self._publish_stats()
        logger.info("engine ready: %s on %s (%s), context %d", self.model_path, self.device,
                    self.dtype, self.max_seq_len)

    def _start_runner(self, log_level: str | None, warmup_ids: list[int] | None):
        """The model on this device, or this rank's part of it with the other ranks started."""
        self.memory_ledger = None
        """The start-up MemoryLedger (one process; ranks log their own)."""
        self.mtp = None
        """The checkpoint's MTP layer, when speculative decoding is on."""
        if self.options.tp_size == 1:
            model = load_model(self.model_path, self.config, self.device, self.dtype,
                               self.options, warmup_ids=warmup_ids)
            state_config = self.config
            if self.options.num_speculative_steps:
                self.mtp = load_mtp_module(self.model_path, model, self.device, self.options)
                state_config = with_mtp_layer(self.config)
            plan, self.memory_ledger = plan_memory(
                state_config, self.options, self.max_seq_len, self.device, self.dtype,
                model=model, graph_sizes=self._graph_rows())
            return ModelRunner(model, plan, state_config), plan
        from glmflash.distributed.parallel import ParallelConfig
        from glmflash.engine.parallel_runner import RankSpec, start_ranks

        parallel = ParallelConfig(self.options.tp_size, self.options.ep_size,
                                  experts_on_rank0=self.device.type == "cuda"
                                  and self.options.kt_num_gpu_experts is not None)
        runner = start_ranks(RankSpec(self.model_path, self.config, self.device.type, self.dtype,
                                      self.options, self.max_seq_len, parallel,
                                      log_level=log_level), warmup_ids)
        return runner, runner.plan

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
        mm = self.media.prepare(prompt_token_ids, media) if media else None
        if mm is not None:
            prompt_token_ids = mm.token_ids
        if self.failure is not None:
            raise EngineDead(f"the engine has stopped: {self.failure}")
        if callable(params):
            params = params(prompt_token_ids)
        self._validate_prompt(prompt_token_ids)
        limit = self.options.max_queued_requests
        if limit is not None and self.num_pending >= limit:
            raise EngineOverloaded("the engine is overloaded; try again later")
        request_id = request_id or f"req-{next(self._request_ids)}"
        seqs = []
        for index in range(n):
            choice_params = params if params.seed is None or index == 0 else \
                _with_seed(params, wrap_seed(params.seed + index))
            seq = Sequence(next(self._seq_ids), prompt_token_ids, choice_params)
            self._choices[seq.seq_id] = _Choice(request_id, index, sink,
                                                SequenceDetokenizer(self.tokenizer, seq), seq)
            seqs.append(seq)
        with self._lock:
            self.num_pending += n
        self._inbox.put(("add", (seqs, mm)))
        if self.options.background_loop:
            self._ensure_thread()
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

    def _speculative_decoder(self) -> SpecDecoder | None:
        options = self.options
        if not options.num_speculative_steps:
            return None
        runner = SpecRunner(self.runner, self.mtp, options.num_speculative_steps,
                            options.max_running_requests)
        policy = DraftPolicy(options.speculative_max_batch_size,
                             options.speculative_min_acceptance,
                             check_speed=not options.disable_speculative_speed_check)
        return SpecDecoder(runner, self.scheduler, self.cache, self.sampler,
                           options.num_speculative_steps, policy, self.max_seq_len)

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture as CUDA graphs (none when off or impossible here)."""
        return decode_graph_sizes(self.options, self.device)

    def _graph_rows(self) -> list[int]:
        """Token rows of every forward captured: the decode sizes, then a verify and a draft
        forward per speculative size (for the memory plan)."""
        rows = 1 + self.options.num_speculative_steps
        spec = [b * rows for b in spec_graph_sizes(self.options, self.device)]
        return self._graph_sizes() + spec + spec

    def _capture_graphs(self) -> None:
        """Decode CUDA graphs at start-up, unless off or impossible here (said once)."""
        options = self.options
        if options.disable_cuda_graph:
            return
        sizes = self._graph_sizes()
        if sizes:
            with measured_peak(self.memory_ledger, "CUDA graphs", self.device,
                               "capturing the CUDA graphs"):
                self.runner.capture_graphs(sizes)
                spec_sizes = spec_graph_sizes(options, self.device)
                if self.spec is not None and spec_sizes:
                    self.spec.runner.capture_graphs(spec_sizes)
        elif options.cuda_graph_bs is not None or self.device.type == "cuda":
            logger.info("decode runs without CUDA graphs: %s",
                        graphs_unsupported(self.device) or "no batch size to capture")

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
        """Take in submissions and aborts, then run one scheduled batch (if any)."""
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

    def _emit(self, deltas: list[TokenDelta]) -> None:
        for delta in deltas:
            seq, choice = delta.seq, self._choices[delta.seq.seq_id]
            visible = delta.token_ids
            if delta.finish_reason == "stop":
                # The scheduler stops only on a stop token (eos or stop_token_ids): not text.
                visible = visible[:-1]
            is_last = delta.finish_reason is not None
            text, num_taken = choice.detok.add_run(visible, is_last=is_last)
            reason = delta.finish_reason
            if text.hit_stop_string:
                _drop_after_stop(seq, delta, len(delta.token_ids) - num_taken)
                if reason is None:
                    self.scheduler.finish(seq, "stop")
                reason = "stop"
            logprobs = seq.logprobs[-len(delta.token_ids):] if seq.params.logprobs is not None \
                and delta.token_ids else None
            out = StreamDelta(choice.request_id, choice.index, text.text, delta.token_ids, reason,
                              logprobs, seq.num_prompt_tokens, seq.num_output_tokens,
                              num_cached_tokens=seq.num_cached_tokens or 0)
            if seq.prompt_logprobs is not None and seq.num_output_tokens == len(delta.token_ids):
                out.prompt_logprobs = seq.prompt_logprobs
            if reason:
                self._finish(seq, choice, out)
            else:
                choice.sink(out)

    def _finish(self, seq: Sequence, choice: _Choice, delta: StreamDelta) -> None:
        if self._choices.pop(seq.seq_id, None) is None:
            return
        self.sampler.release(seq)
        self.runner.prompt_logprobs.release(seq)
        self.progress.release(seq)
        with self._lock:
            self.num_pending -= 1
        delta.num_prompt_tokens = seq.num_prompt_tokens
        delta.num_output_tokens = seq.num_output_tokens
        delta.num_cached_tokens = seq.num_cached_tokens or 0
        delta.speculative = (seq.num_draft_tokens, seq.num_accepted_tokens, seq.num_verify_steps)
        choice.sink(delta)

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("a prompt needs at least one token")
        if any(not 0 <= t < self.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        if len(token_ids) >= self.max_seq_len:
            raise PromptTooLong(len(token_ids), self.max_seq_len)


def _drop_after_stop(seq: Sequence, delta: TokenDelta, num_dropped: int) -> None:
    """A stop string ended the text before the last of a run's tokens: the tokens after the
    one that completed it are not output (nor their logprobs)."""
    if num_dropped <= 0:
        return
    del delta.token_ids[-num_dropped:]
    del seq.token_ids[-num_dropped:]
    if seq.params.logprobs is not None:
        del seq.logprobs[-num_dropped:]


def warmup_text() -> str:
    """Generic prose to route through the model at start (expert placement by frequency)."""
    return resources.files("glmflash.assets").joinpath("tiny_corpus.txt").read_text()[:8000]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    return replace(params, seed=seed)
