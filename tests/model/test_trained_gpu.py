"""The whole trained tiny model in bf16 on the GPU (Triton kernels) against the CPU fp32
reference: greedy tokens on held-out prompts."""

from __future__ import annotations

import pytest

from glmflash import Engine
from glmflash.tiny.embedded import embedded_checkpoint
from tools.eval_tiny import held_out_tasks, held_out_tool_cases
from tools.tiny_eval_models import greedy_agreement, greedy_outputs

pytestmark = pytest.mark.gpu

# Issue 16's goal is 0.95 (bf16 Triton vs the fp32 reference); the shipped model reaches 0.875
# on the H200 (2026-12-01): an under-trained model has many near ties. This floor is the measured
# level, so that a regression shows; the goal is not met yet.
MIN_POSITION_AGREEMENT = 0.85
MAX_TOKENS = 48


def _prompts(engine: Engine) -> list[list[int]]:
    chats = [([{"role": "user", "content": t.question}], None)
             for t in held_out_tasks(2000, 4)]
    chats += [([{"role": "user", "content": c.user}], c.tools)
              for c in held_out_tool_cases(2000, 4, set())]
    return [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(m, tools=t))
            for m, t in chats]


def test_trained_model_bf16_on_gpu_agrees_with_cpu_fp32():
    cpu = Engine(embedded_checkpoint(), device="cpu", dtype="float32", context_length=2048)
    try:
        prompts = _prompts(cpu)
        reference = greedy_outputs(cpu, prompts, MAX_TOKENS)
    finally:
        cpu.shutdown()
    gpu = Engine(embedded_checkpoint(), device="cuda", dtype="bfloat16", context_length=2048)
    try:
        agreement = greedy_agreement(reference, greedy_outputs(gpu, prompts, MAX_TOKENS))
    finally:
        gpu.shutdown()
    print(agreement)
    assert agreement["num_prompts"] == 16
    assert agreement["position_agreement"] >= MIN_POSITION_AGREEMENT
