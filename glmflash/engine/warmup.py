"""Start-up warm-up, so that no request pays for a compile.

* CPU experts: the Numba kernels compile once into Numba's on-disk cache (`cache=True`) and are
  loaded from it on later starts; the log says which.
* Model kernels: a few forwards on dummy sequences cover every kernel family a server runs -
  a fresh varlen prefill, a prefill continuing a cached prefix beside a decode, decodes of two
  and one sequences, and on a GPU a chunk as long as `chunked_prefill_size` (large-M GEMM
  configurations) and the layerwise expert path when `kt_gpu_prefill_token_threshold` is set.
  On a CPU the same small schedule runs (cheap: it exercises the path, there is nothing to
  compile). The dummy sequences take cache pages and state slots like any request and give them
  back; a phase the cache cannot hold at once is skipped.
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


def warm_up_cpu_experts(model: GlmForCausalLM, num_threads: int | None = None,
                        num_pools: int = 1) -> None:
    """Build the CPU expert kernels with these options (`Experts.build_cpu_kernel`) and compile
    (first start) or load them (later starts)."""
    from glmflash.model.moe import Experts

    kernels = [m.build_cpu_kernel(num_threads, num_pools) for m in model.modules()
               if isinstance(m, Experts) and m.gate_proj.fp8_block
               and m.gate_proj.weight.device.type == "cpu"]
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
    phases = [p for p in (_small_phase(engine), _long_phase(engine)) if p and _fits(engine, p)]
    steps = [step for phase in phases for step in phase]
    logger.info("warming up the model kernels on %s: %d forwards (%s)", engine.device,
                len(steps), ", ".join(name for name, _ in steps))
    for phase in phases:
        try:
            for _, batch in phase:
                _run(engine, batch)
        finally:
            for seq in _seqs(phase):
                engine.cache.free(seq)
    engine.cache.check_integrity()
    logger.info("model kernels warm in %.1f s", time.perf_counter() - start)


Phase = list[tuple[str, ScheduledBatch]]


def _small_phase(engine: Engine) -> Phase:
    """Two sequences (one if the engine runs one at a time): chunked, alongside, decoding."""
    a, b = (_dummy(engine, -1 - i, n) for i, n in enumerate(SMALL_PROMPTS))
    rest = a.num_tokens - FIRST_CHUNK
    if engine.cache.plan.num_state_slots < 2:
        return [("prefill", ScheduledBatch([a], [FIRST_CHUNK], [False])),
                ("prefix prefill", ScheduledBatch([a], [rest], [True])),
                ("decode x1", ScheduledBatch([a], [1], [True]))]
    return [("prefill", ScheduledBatch([a, b], [FIRST_CHUNK, b.num_tokens], [False, True])),
            ("prefix prefill + decode", ScheduledBatch([a, b], [rest, 1], [True, True])),
            ("decode x2", ScheduledBatch([a, b], [1, 1], [True, True])),
            ("decode x1", ScheduledBatch([a], [1], [True]))]


def _long_phase(engine: Engine) -> Phase:
    long_len = _long_prefill_len(engine)
    if not long_len:
        return []
    c = _dummy(engine, -3, long_len)
    return [(f"prefill of {long_len}", ScheduledBatch([c], [long_len], [True]))]


def _seqs(phase: Phase) -> list[Sequence]:
    return list({id(s): s for _, batch in phase for s in batch.seqs}.values())


def _fits(engine: Engine, phase: Phase) -> bool:
    """Whether the phase's sequences fit the cache at once (a tiny test cache may not)."""
    cache, seqs = engine.cache, _seqs(phase)
    totals = {id(s): 0 for s in seqs}
    for _, batch in phase:
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            totals[id(seq)] += n
    pages = sum(-(-t // cache.page_size) for t in totals.values())
    if len(seqs) <= len(cache.free_state_slots) and pages <= cache.num_free_pages:
        return True
    logger.debug("warm-up phase %s skipped: the cache is too small", phase[0][0])
    return False


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
        if seq.state_slot is None:
            engine.cache.allocate(seq, n)
        else:
            engine.cache.append(seq, n)
    # The runner's page table learns the pages this step handed out, as from the scheduler.
    batch.page_updates = engine.cache.take_page_updates()
    logits = engine.runner.run(batch)
    sampled = [s for s, need in zip(batch.seqs, batch.needs_sample, strict=True) if need]
    tokens = engine.sampler.sample(logits, sampled)
    for seq, n, need in zip(batch.seqs, batch.num_tokens, batch.needs_sample, strict=True):
        seq.num_computed_tokens += n
        if need:
            seq.token_ids.append(tokens[sampled.index(seq)])
    for seq in sampled:
        engine.sampler.release(seq)
