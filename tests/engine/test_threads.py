"""An engine without its own thread (`background_loop=False`) driven by callers on several
threads at once: they take turns at `step`, and each gets the tokens it gets alone."""

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
