"""`glmflash.Engine`: the embedded library. One step = schedule, run, sample, update."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmflash.config import ModelConfig
from glmflash.engine.model_runner import ModelRunner, load_model
from glmflash.engine.sampler import Sampler
from glmflash.engine.sequence import Sequence, SequenceStatus
from glmflash.sampling_params import SamplingParams
from glmflash.tokenizer import Tokenizer
from glmflash.utils.logging import setup_logging

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class Result:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[dict[int, float]] | None = None
    """Per generated token: token id -> logprob for the top-k and the sampled token."""
    extra: dict = field(default_factory=dict)


class Engine:
    """Loads a checkpoint (the embedded tiny one when `model_path` is None) and generates."""

    def __init__(self, model_path: str | Path | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, **options) -> None:
        setup_logging(options.pop("log_level", None))
        if model_path is None:
            from glmflash.tiny.embedded import embedded_checkpoint
            model_path = embedded_checkpoint()
        self.model_path = Path(model_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(dtype, self.device)
        self.config = ModelConfig.from_hf(self.model_path)
        self.tokenizer = Tokenizer.from_dir(self.model_path)
        self.max_seq_len = int(options.pop("context_length", None) or 4096)
        max_num_seqs = int(options.pop("max_running_requests", None) or 16)
        self.sampler = Sampler(options.pop("seed", None))
        if options:
            raise TypeError(f"unknown Engine options: {sorted(options)}")
        model = load_model(self.model_path, self.config, self.device, self.dtype)
        self.runner = ModelRunner(model, max_num_seqs=max_num_seqs, max_seq_len=self.max_seq_len)
        self.eos_token_ids = set(self.config.eos_token_id) | set(self.tokenizer.eos_token_ids)
        self._ids = itertools.count()
        logger.info("engine ready: %s on %s (%s)", self.model_path, self.device, self.dtype)

    def generate(self, prompts: str | list[str] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
                 prompt_token_ids: list[int] | list[list[int]] | None = None) -> list[Result]:
        """Generate for every prompt (text, or token ids); results in prompt order."""
        token_lists = self._prompt_token_lists(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params, len(token_lists))
        seqs = [self._new_sequence(ids, p) for ids, p in zip(token_lists, params)]
        waiting, running = list(seqs), []
        while waiting or running:
            while waiting and self.runner.can_allocate():
                seq = waiting.pop(0)
                self.runner.allocate(seq)
                seq.status = SequenceStatus.RUNNING
                running.append(seq)
            self.step(running)
            running = [s for s in running if not s.is_finished]
        return [self._result(s) for s in seqs]

    def step(self, running: list[Sequence]) -> None:
        logits = self.runner.run(running)
        for seq, token in zip(running, self.sampler.sample(logits, running)):
            seq.token_ids.append(token)
            self._check_stop(seq)
            if seq.is_finished:
                self.runner.free(seq)
                self.sampler.release(seq)

    def _new_sequence(self, token_ids: list[int], params: SamplingParams) -> Sequence:
        if len(token_ids) >= self.runner.max_seq_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens does not fit the context length "
                             f"{self.runner.max_seq_len}")
        if any(not 0 <= t < self.config.vocab_size for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.config.vocab_size})")
        return Sequence(next(self._ids), token_ids, params)

    def _prompt_token_lists(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts and prompt_token_ids")
        if prompts is not None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            return [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            return [list(prompt_token_ids)]
        return [list(ids) for ids in prompt_token_ids]

    def _check_stop(self, seq: Sequence) -> None:
        params, token = seq.params, seq.token_ids[-1]
        if token in params.stop_token_ids or (token in self.eos_token_ids
                                              and not params.ignore_eos):
            seq.finish("stop")
        elif params.stop and any(s in self._text(seq) for s in params.stop):
            seq.finish("stop")
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.runner.max_seq_len:
            seq.finish("length")

    def _text(self, seq: Sequence) -> str:
        ids = seq.output_token_ids
        if seq.finish_reason == "stop" and ids and (ids[-1] in self.eos_token_ids
                                                    or ids[-1] in seq.params.stop_token_ids):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)

    def _result(self, seq: Sequence) -> Result:
        text = self._text(seq)
        for stop in seq.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        return Result(prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
                      token_ids=seq.output_token_ids, text=text, finish_reason=seq.finish_reason,
                      logprobs=seq.logprobs if seq.params.logprobs is not None else None)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _per_prompt(params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
