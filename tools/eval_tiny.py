"""Evaluate the trained tiny checkpoint on held-out generated prompts:

    python tools/eval_tiny.py [CHECKPOINT] [--seed 1000] [--per-family 32] [--tools 48]

* template tasks through `Engine.chat`, greedy: exact match of the answer, and whether the output
  split into reasoning and content (a non-empty `<think>` part and the answer after it);
* tool use through `Engine.chat` with tool schemas the training never produced: the rate of
  outputs with a tool call, and of calls with the right name and arguments;
* questions on held-out generated pictures (PNG data URLs) through `Engine.chat`: exact match;
* the MTP layer: top-1 agreement with the main model's next-next token on the generated parts;
* greedy tokens in bf16 against fp32 on the CPU.

`--mtp-acceptance STEPS` instead measures speculative decoding's acceptance (STEPS chained
drafts) on the task prompts, beside the MTP agreement over the same outputs.

Held-out prompts come from their own seed; tool names seen in training are skipped (the training
stream is regenerated from the manifest).
"""

from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

from glmflash import Engine
from glmflash.config import ModelConfig
from glmflash.sampling_params import SamplingParams
from glmflash.tiny.embedded import embedded_checkpoint
from glmflash.tiny.manifest import read_manifest
from tools.tiny_data import SampleMaker, Seen
from tools.tiny_eval_models import bf16_agreement, mtp_agreement
from tools.tiny_tasks import QA_FAMILIES, Task
from tools.tiny_tool_tasks import ToolCase, tool_case
from tools.tiny_vision_tasks import ImageTask, data_url, image_task

MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@lru_cache(maxsize=2)
def training_seen(checkpoint: Path) -> Seen:
    """Questions and tool names of the checkpoint's training stream (from its manifest)."""
    from tools.train_tiny import batches

    training = read_manifest(checkpoint)["training"]
    seen = Seen()
    maker = SampleMaker(checkpoint, ModelConfig.from_hf(checkpoint))
    stream = batches(maker, training["seed"], training["tokens_per_step"], seen)
    for _ in range(training["steps"]):
        next(stream)
    return seen


def held_out_tasks(seed: int, per_family: int) -> list[Task]:
    rng = random.Random(seed)
    return [family(rng) for family in QA_FAMILIES for _ in range(per_family)]


def held_out_tool_cases(seed: int, count: int, seen_names: set[str]) -> list[ToolCase]:
    rng, cases = random.Random(seed + 1), []
    while len(cases) < count:
        case = tool_case(rng)
        if not any(t["function"]["name"] in seen_names for t in case.tools):
            cases.append(case)
    return cases


def _chat_all(engine: Engine, conversations: list[tuple[list, list | None]]):
    """Engine.chat on every (messages, tools), concurrently so the engine batches them."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda c: engine.chat(c[0], tools=c[1], sampling_params=GREEDY),
                             conversations))


def eval_tasks(engine: Engine, tasks: list[Task], seen_questions: set[str]) -> dict:
    results = _chat_all(engine, [([{"role": "user", "content": t.question}], None)
                                 for t in tasks])
    report = {}
    for family in dict.fromkeys(t.family for t in tasks):
        rows = [(t, r) for t, r in zip(tasks, results, strict=True) if t.family == family]
        report[family] = dict(
            exact_match=_rate((r.content or "").strip() == t.answer for t, r in rows),
            reasoning_split=_rate(bool(r.reasoning_content) and bool(r.content) for _, r in rows),
            unseen_prompts=_rate(t.question not in seen_questions for t, _ in rows))
    report["exact_match"] = _rate((r.content or "").strip() == t.answer
                                  for t, r in zip(tasks, results, strict=True))
    report["sequences"] = [r.result.prompt_token_ids + r.result.token_ids for r in results]
    report["prompt_lens"] = [len(r.result.prompt_token_ids) for r in results]
    return report


def held_out_images(seed: int, count: int) -> list[ImageTask]:
    rng = random.Random(seed + 2)
    return [image_task(rng) for _ in range(count)]


def eval_images(engine: Engine, tasks: list[ImageTask]) -> dict:
    """Questions on held-out pictures, sent as PNG data URLs through `Engine.chat`."""
    results = _chat_all(engine, [([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(t.image)}},
        {"type": "text", "text": t.question}]}], None) for t in tasks])
    return dict(exact_match=_rate((r.content or "").strip() == t.answer
                                  for t, r in zip(tasks, results, strict=True)),
                reasoning_split=_rate(bool(r.reasoning_content) for r in results))


def eval_tool_calls(engine: Engine, cases: list[ToolCase]) -> dict:
    results = _chat_all(engine, [([{"role": "user", "content": c.user}], c.tools) for c in cases])
    right = [len(r.tool_calls) == 1 and r.tool_calls[0].name == c.name
             and json.loads(r.tool_calls[0].arguments) == c.arguments
             for c, r in zip(cases, results, strict=True)]
    return dict(tool_call_rate=_rate(bool(r.tool_calls) for r in results),
                right_name=_rate(bool(r.tool_calls) and r.tool_calls[0].name == c.name
                                 for c, r in zip(cases, results, strict=True)),
                right_call=_rate(right),
                finish_tool_calls=_rate(r.finish_reason == "tool_calls" for r in results))


def _rate(flags) -> float:
    flags = list(flags)
    return round(sum(flags) / max(1, len(flags)), 4)


def evaluate(checkpoint: Path, seed: int, per_family: int, num_tools: int,
             num_compare: int = 16) -> dict:
    seen = training_seen(checkpoint)
    engine = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                    skip_kernel_warmup=True)
    try:
        tasks = eval_tasks(engine, held_out_tasks(seed, per_family), seen.questions)
        tools = eval_tool_calls(engine, held_out_tool_cases(seed, num_tools, seen.tool_names))
        images = eval_images(engine, held_out_images(seed, per_family))
        prompts = [s[:n] for s, n in zip(tasks["sequences"], tasks["prompt_lens"], strict=True)]
        step = max(1, len(prompts) // num_compare)
        compare = prompts[::step][:num_compare]
        bf16 = bf16_agreement(checkpoint, engine, compare, MAX_TOKENS)
    finally:
        engine.shutdown()
    mtp = mtp_agreement(checkpoint, tasks.pop("sequences"), tasks.pop("prompt_lens"))
    return dict(tasks=tasks, tools=tools, images=images, mtp_agreement=mtp, bf16_vs_fp32=bf16)


def mtp_acceptance(checkpoint: Path, seed: int, per_family: int, num_steps: int = 1) -> dict:
    """Speculative decoding's real acceptance on the held-out task prompts (greedy, MTP on),
    beside the MTP layer's measured agreement over the same outputs."""
    engine = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                    skip_kernel_warmup=True, speculative_algorithm="NEXTN",
                    speculative_num_steps=num_steps, speculative_max_batch_size=64,
                    speculative_min_acceptance=0.0)
    try:
        tasks = eval_tasks(engine, held_out_tasks(seed, per_family), set())
        stats = engine.stats().speculative
    finally:
        engine.shutdown()
    return dict(acceptance_rate=round(stats.acceptance_rate, 4),
                per_position=[round(a, 4) for a in stats.position_acceptance()],
                mean_accepted_length=round(stats.mean_accepted_length, 4),
                num_draft_tokens=stats.num_draft_tokens,
                mtp_agreement=mtp_agreement(checkpoint, tasks["sequences"], tasks["prompt_lens"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--per-family", type=int, default=32)
    parser.add_argument("--tools", type=int, default=48)
    parser.add_argument("--mtp-acceptance", type=int, metavar="STEPS", default=None,
                        help="only measure speculative decoding's acceptance with STEPS drafts")
    args = parser.parse_args()
    checkpoint = args.checkpoint or embedded_checkpoint()
    if args.mtp_acceptance:
        print(json.dumps(mtp_acceptance(checkpoint, args.seed, args.per_family,
                                        args.mtp_acceptance), indent=2))
        return
    print(json.dumps(evaluate(checkpoint, args.seed, args.per_family, args.tools), indent=2))


if __name__ == "__main__":
    main()
