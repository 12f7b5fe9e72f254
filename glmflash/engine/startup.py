"""Engine start-up: the model runner (one process or tensor-parallel ranks), speculative
decoding's parts, and the CUDA graphs captured before the first request."""

from __future__ import annotations

import logging
from importlib import resources

import torch

from glmflash.engine.cuda_graph import decode_graph_sizes, graphs_unsupported, spec_graph_sizes
from glmflash.engine.memory_plan import measured_peak, plan_memory
from glmflash.engine.model_runner import ModelRunner, load_model
from glmflash.engine.spec_policy import DraftPolicy
from glmflash.engine.spec_runner import SpecRunner, load_mtp_module
from glmflash.engine.speculative import SpecDecoder
from glmflash.model.mtp import with_mtp_layer

logger = logging.getLogger(__name__)

WARMUP_TOKENS = 1024
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


class EngineStartupMixin:
    """The start-up steps of `Engine` that build its runner, drafts and graphs."""

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
        from glmflash.distributed.parallel import ParallelConfig, check_divisible
        from glmflash.engine.parallel_runner import RankSpec, start_ranks

        parallel = ParallelConfig(self.options.tp_size, self.options.ep_size,
                                  experts_on_rank0=self.device.type == "cuda"
                                  and self.options.kt_num_gpu_experts is not None)
        check_divisible(self.config, parallel)  # here, once, before any rank is started
        runner = start_ranks(RankSpec(self.model_path, self.config, self.device.type, self.dtype,
                                      self.options, self.max_seq_len, parallel,
                                      log_level=log_level), warmup_ids)
        return runner, runner.plan

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


def warmup_text() -> str:
    """Generic prose to route through the model at start (expert placement by frequency)."""
    return resources.files("glmflash.assets").joinpath("tiny_corpus.txt").read_text()[:8000]


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; choose one of {sorted(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]
