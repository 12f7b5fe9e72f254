"""Start-up warm-up, so that no request pays for a compile.

* CPU experts: the Numba kernels compile once into Numba's on-disk cache (`cache=True`) and are
  loaded from it on later starts; the log says which.
* Model kernels: a few forwards on dummy sequences cover every kernel family a server runs -
  a fresh varlen prefill, a prefill continuing a cached prefix beside a decode, decodes of two
  and one sequences, and on a GPU a chunk as long as `chunked_prefill_size` (large-M GEMM
  configurations) and the layerwise expert path when `kt_gpu_prefill_token_threshold` is set.
  On a CPU the same small schedule runs (cheap: it exercises the path, there is nothing to
  compile). The dummy sequences take cache pages and state slots like any request and give them
  back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from glmflash.engine.scheduler import ScheduledBatch
from glmflash.engine.sequence import Sequence
from glmflash.sampling_params import SamplingParams

if TYPE_CHECKING:
    from glmflash.engine.engine import Engine
    from glmflash.model.glm import GlmForCausalLM

logger = logging.getLogger(__name__)

# Prompt tokens of the two small dummy sequences; the first is prefilled in two chunks.
SMALL_PROMPTS = (24, 7)
FIRST_CHUNK = 16
_GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def warm_up_cpu_experts(model: GlmForCausalLM) -> None:
    """Build the CPU expert kernels and compile (first start) or load them (later starts)."""
    from glmflash.model.moe import Experts

    kernels = [m.cpu_experts() for m in model.modules() if isinstance(m, Experts)
               and m.gate_proj.fp8_block and m.gate_proj.weight.device.type == "cpu"]
    if not kernels:
        return
    where = _numba_cache_dir()
    if where is None:
        logger.info("compiling CPU expert kernels, first start only (about 30 s; later starts "
                    "load them from Numba's cache)")
    else:
        logger.info("loading the CPU expert kernels from Numba's cache in %s", where)
    start = time.perf_counter()
    for kernel in kernels:
        kernel.warmup()
    logger.info("CPU expert kernels ready in %.1f s", time.perf_counter() - start)


def _numba_cache_dir() -> str | None:
    """Where the compiled expert kernels are cached, or None when they must be compiled."""
    try:
        from glmflash.kernels.cpu_moe import numba_impl
    except ImportError:
        return None
    kernels = (numba_impl._gate_up_nb, numba_impl._down_nb, numba_impl._group_nb)
    try:
        # NOTE: Numba's cache internals; an index that does not match the source loads empty.
        if all(k._cache._cache_file._load_index() for k in kernels):
            return kernels[0]._cache.cache_path
    except (AttributeError, OSError):
        logger.debug("cannot read Numba's cache index", exc_info=True)
    return None


def warm_up_kernels(engine: Engine) -> None:
    """Run the dummy schedule through the real runner and sampler, then free its cache."""
    start = time.perf_counter()
    steps = _schedule(engine)
    logger.info("warming up the model kernels on %s: %d forwards (%s)", engine.device,
                len(steps), ", ".join(name for name, _ in steps))
    seqs = {id(s): s for _, batch in steps for s in batch.seqs}.values()
    try:
        for _, batch in steps:
            _run(engine, batch)
    finally:
        for seq in seqs:
            engine.cache.free(seq)
    engine.cache.check_integrity()
    logger.info("model kernels warm in %.1f s", time.perf_counter() - start)


def _schedule(engine: Engine) -> list[tuple[str, ScheduledBatch]]:
    """The dummy batches, in order; their state slots are taken here, pages as they run."""
    a, b = (_dummy(engine, -1 - i, n) for i, n in enumerate(SMALL_PROMPTS))
    cache = engine.cache
    cache.allocate(a, FIRST_CHUNK)
    cache.allocate(b, b.num_tokens)
    steps = [("prefill", ScheduledBatch([a, b], [FIRST_CHUNK, b.num_tokens], [False, True]))]
    rest = a.num_tokens - FIRST_CHUNK
    steps.append(("prefix prefill + decode", ScheduledBatch([a, b], [rest, 1], [True, True])))
    steps.append(("decode x2", ScheduledBatch([a, b], [1, 1], [True, True])))
    steps.append(("decode x1", ScheduledBatch([a], [1], [True])))
    long_len = _long_prefill_len(engine)
    if long_len:
        c = _dummy(engine, -3, long_len)
        if cache.can_allocate(c, long_len):
            cache.allocate(c, long_len)
            steps.append((f"prefill of {long_len}", ScheduledBatch([c], [long_len], [True])))
    return steps


def _long_prefill_len(engine: Engine) -> int:
    """GPU only: a chunk as long as the engine schedules, or the layerwise threshold."""
    if engine.device.type != "cuda":
        return 0
    options = engine.options
    wanted = max(options.chunked_prefill_size, options.kt_gpu_prefill_token_threshold or 0)
    return min(wanted, engine.max_seq_len - 1)


def _dummy(engine: Engine, seq_id: int, num_tokens: int) -> Sequence:
    vocab = engine.config.vocab_size
    return Sequence(seq_id, [(7919 * i + 11) % vocab for i in range(num_tokens)], _GREEDY)


def _run(engine: Engine, batch: ScheduledBatch) -> None:
    """One step as the engine runs it: pages for the new tokens, forward, sample, advance."""
    for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
        engine.cache.append(seq, n)
    logits = engine.runner.run(batch)
    sampled = [s for s, need in zip(batch.seqs, batch.needs_sample, strict=True) if need]
    tokens = engine.sampler.sample(logits, sampled)
    for seq, n, need in zip(batch.seqs, batch.num_tokens, batch.needs_sample, strict=True):
        seq.num_computed_tokens += n
        if need:
            seq.token_ids.append(tokens[sampled.index(seq)])
    for seq in sampled:
        engine.sampler.release(seq)
