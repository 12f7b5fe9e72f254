"""Helpers of the speculative-decoding tests: the trained tiny model's small engine (pages,
slots and chunks small enough to preempt), arrivals over steps, requests started by hand, the
MTP layer's cache of a sequence, and spec graphs replaced by forwards run again (on the CPU:
the `rerun_graphs` fixture of conftest.py)."""

from __future__ import annotations

import json

import numpy as np
import torch

from glmflash import Engine, SamplingParams
from glmflash.config import ModelConfig
from glmflash.engine.options import EngineConfig
from glmflash.engine.outputs import ResultCollector
from glmflash.engine.sequence import Sequence
from glmflash.engine.spec_graphs import SpecGraphRunner
from glmflash.model.forward_batch import token_slots_of
from glmflash.model.mtp import with_mtp_layer
from glmflash.model.state import cache_bytes
from glmflash.tiny.embedded import embedded_checkpoint

TRAINED = embedded_checkpoint()
# 5 pages of 8 tokens, 3 state slots, chunks of 7: the arrivals below cannot all fit, so the
# scheduler preempts and recomputes, and prompts are prefilled in several chunks.
SMALL = dict(context_length=40, page_size=8, chunked_prefill_size=7, max_running_requests=3,
             background_loop=False, check_integrity=True, skip_kernel_warmup=True,
             disable_radix_cache=True)
SPEC = dict(speculative_algorithm="NEXTN", speculative_num_steps=2)
TEXTS = ["Once upon a time, a little fox", "The cat sat on the", "Tom has three apples and",
         "In the morning the sun", "A dog ran to the park and", "Hello! My name is"]


def budget_gb(options: dict, pages: int) -> float:
    config = ModelConfig.from_dict(json.loads((TRAINED / "config.json").read_text()))
    engine_config = EngineConfig(**options)
    if engine_config.num_speculative_steps:
        config = with_mtp_layer(config)
    per_token, per_slot = cache_bytes(config, torch.float32)
    slots = engine_config.max_running_requests * (1 + engine_config.num_speculative_steps) + \
        engine_config.num_state_snapshots
    return (slots * per_slot + pages * options["page_size"] * per_token) / 2**30


def spec_engine(pages: int = 5, device: str = "cpu", **extra) -> Engine:
    """The small engine; on the CPU its cache holds `pages` pages (on a GPU the memory plan
    sizes it: every running sequence fits, so nothing is preempted there)."""
    options = {**SMALL, **extra}
    if device == "cpu":
        options["cache_budget_gb"] = budget_gb(options, pages)
    return Engine(TRAINED, device=device, dtype="float32", **options)


def run_arrivals(engine: Engine, prompts: list[list[int]], arrivals: list[int],
                  params: SamplingParams) -> list[ResultCollector]:
    collectors, step = [], 0
    while step <= max(arrivals) or not all(c.is_done for c in collectors):
        for prompt, at in zip(prompts, arrivals, strict=True):
            if at == step:
                collector = ResultCollector("", prompt, 1)
                collector.request_id = engine.add_request(prompt, params, collector.add)
                collectors.append(collector)
        engine.step()
        step += 1
        assert step < 400
    return collectors


class RerunForward:
    """A stand-in for a captured graph: `replay` runs the forward again and copies its outputs
    into the tensors the first run returned."""

    def __init__(self, forward) -> None:
        self.forward = forward
        self.outputs = forward()
        self.num_replays = 0

    def replay(self) -> None:
        for static, fresh in zip(self.outputs, self.forward(), strict=True):
            static.copy_(fresh)
        self.num_replays += 1

    def pool(self) -> None:
        return None


def record_rerun(forward, pool, device):
    graph = RerunForward(forward)
    return graph, graph.outputs


def with_graphs(engine, sizes: list[int]) -> SpecGraphRunner:
    spec = engine.spec.runner
    spec.graphs = SpecGraphRunner(spec, sizes, engine.options.num_speculative_steps)
    spec.graphs.capture_all(None)
    return spec.graphs


def start_request(engine, prompt: list[int], params: SamplingParams
                  ) -> tuple[ResultCollector, Sequence]:
    """Add a request and take it into the scheduler's queue (no step run)."""
    collector = ResultCollector("", prompt, 1)
    collector.request_id = engine.add_request(prompt, params, collector.add)
    engine._drain_inbox(block=False)
    return collector, engine.scheduler.waiting[-1]


def mtp_cache(engine, seq: Sequence, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer's latents of positions 0..num_positions-1 and its pooled indexer keys of the
    pools complete among them."""
    state, layer = engine.runner.state, engine.spec.runner.mtp_layer
    kpool = engine.runner.kpool
    slots = token_slots_of(seq.page_ids, 0, num_positions, engine.cache.page_size)
    pools = slots[kpool - 1:: kpool] // kpool
    return state.latent[layer][torch.from_numpy(slots)].clone(), \
        state.pool_keys[layer][torch.from_numpy(np.asarray(pools))].clone()
