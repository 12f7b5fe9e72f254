"""A GPU decode step (batch preparation, forward, sampling) never waits for the device.

`torch.cuda.set_sync_debug_mode("error")` raises on any host synchronisation (`.item()`,
`.tolist()`, blocking copies, `nonzero`, ...). Only the final wait for the sampled ids, an event
on their copy, is outside the checked region.
"""

from __future__ import annotations

import pytest
import torch

from glmflash import Engine, SamplingParams

pytestmark = pytest.mark.gpu


def _requests(engine: Engine) -> None:
    greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=20, seed=3,
                             logprobs=2, repetition_penalty=1.1, ignore_eos=True)
    for i, params in enumerate((greedy, sampled, greedy)):
        engine.add_request([11 + i, 40, 7, 300 + i] * (5 + 10 * i), params, lambda d: None)


def _decode_steps_without_sync(engine: Engine, steps: int) -> None:
    for _ in range(steps):
        batch = engine.scheduler.schedule()
        assert all(n == 1 for n in batch.num_tokens), "expected a pure decode batch"
        seqs = [s for s, need in zip(batch.seqs, batch.needs_sample, strict=True) if need]
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = engine.runner.run(batch)
            out = engine.sampler.sample_on_device(logits, seqs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        out.copy_done.synchronize()
        token_ids = out.packed_cpu[: len(seqs)].tolist()
        engine.scheduler.update(batch, token_ids)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["all-gpu", "hybrid"])
def test_decode_step_has_no_host_sync(tiny_dirs, hybrid, graphs):
    options = dict(kt_num_gpu_experts=2, kt_cpuinfer=2) if hybrid else {}
    engine = Engine(tiny_dirs["embedded"], device="cuda", dtype="bfloat16", context_length=512,
                    background_loop=False, disable_cuda_graph=not graphs, **options)
    try:
        _requests(engine)
        engine.step()  # admission and prefill (may sync: not a decode step)
        while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running):
            engine.step()
        # Decodes cross a page boundary and a k-pool boundary on the way.
        _decode_steps_without_sync(engine, steps=9)
        engine.check_integrity()
    finally:
        engine.shutdown()
