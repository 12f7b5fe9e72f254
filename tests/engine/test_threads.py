"""An engine without its own thread (`background_loop=False`) driven by callers on several
threads at once, or by several coroutines: they take turns at `step`, and each gets the tokens
it gets alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from glmflash import Engine, SamplingParams
from glmflash.tiny.embedded import random_tiny_checkpoint

PROMPTS = [[5 + i, 17, 99, 3 + i] * (2 + i % 3) for i in range(8)]


def test_callers_on_several_threads_drive_one_engine():
    engine = Engine(random_tiny_checkpoint(), device="cpu", context_length=256,
                    background_loop=False, skip_kernel_warmup=True)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        alone = [engine.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
                 for p in PROMPTS]

        def run(prompt: list[int]) -> list[int]:
            return engine.generate(prompt_token_ids=[prompt], sampling_params=params)[0].token_ids

        with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
            together = list(pool.map(run, PROMPTS, timeout=120))
        assert together == alone
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_async_callers_drive_an_engine_without_its_thread():
    """`agenerate` / `astream` with `background_loop=False`: the consumers drive the steps (off
    the event loop) instead of waiting for a thread that never starts."""
    import asyncio

    engine = Engine(random_tiny_checkpoint(), device="cpu", context_length=256,
                    background_loop=False, skip_kernel_warmup=True)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        alone = [engine.generate(prompt_token_ids=[p], sampling_params=params)[0].token_ids
                 for p in PROMPTS[:4]]

        async def together():
            return await asyncio.wait_for(asyncio.gather(*[
                engine.agenerate(prompt_token_ids=p, sampling_params=params)
                for p in PROMPTS[:4]]), timeout=120)

        assert [r.token_ids for r in asyncio.run(together())] == alone
        engine.check_integrity()
    finally:
        engine.shutdown()
