"""Evaluate the trained tiny checkpoint on held-out generated prompts:

    python tools/eval_tiny.py [CHECKPOINT] [--seed 1000] [--per-family 32] [--tools 48]
    python tools/eval_tiny.py [CHECKPOINT] --record [--gpu-check]

* template tasks through `Engine.chat`, greedy: exact match of the answer, and whether the output
  split into reasoning and content (a non-empty `<think>` part and the answer after it);
* tool use through `Engine.chat` with tool schemas the training never produced: the rate of
  outputs with a tool call, and of calls with the right name and arguments;
* questions on held-out generated pictures (PNG data URLs) through `Engine.chat`: exact match,
  for the shape pictures and for pictures of a written word (data recipe 2);
* the MTP layer: top-1 agreement with the main model's next-next token on the generated parts;
* greedy tokens in bf16 against fp32 on the CPU.

Held-out prompts come from their own seed and from the held-out part of each family
(`tiny_data.is_held_out`: a fixed eighth of the questions and tool names, which training never
draws). `record_eval` (train_tiny.py --eval) measures a checkpoint at the CI test's sizes and
writes the figures into its manifest, where the tests read their floors.

`--mtp-acceptance STEPS` instead measures speculative decoding's acceptance (STEPS chained
drafts) on the task prompts, beside the MTP agreement over the same outputs; `--index-keys`
the template tasks with FP8 pooled indexer keys (and FP8 keys with e4m3 queries) against the
model dtype's.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from glmflash import Engine
from glmflash.sampling_params import SamplingParams
from glmflash.tiny.embedded import embedded_checkpoint
from glmflash.tiny.manifest import MANIFEST, read_manifest
from tools.tiny_data import is_held_out
from tools.tiny_eval_models import (
    bf16_agreement,
    greedy_agreement,
    greedy_outputs,
    mtp_agreement,
    mtp_hits,
    scheduled_acceptance,
)
from tools.tiny_tasks import QA_FAMILIES, Task
from tools.tiny_tool_tasks import ToolCase, tool_case
from tools.tiny_vision_tasks import PALETTE, ImageTask, data_url, image_task, word_task

logger = logging.getLogger("glmflash.eval_tiny")
MAX_TOKENS = 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
# The sizes of the CI test (tests/tiny/test_trained.py), recorded in the manifest by `record_eval`.
CI_SIZES = dict(seed=1000, per_family=16, num_tools=16, num_compare=16)
GPU_CHECK_TOKENS = 48


def held_out_tasks(seed: int, per_family: int) -> list[Task]:
    rng, tasks = random.Random(seed), []
    for family in QA_FAMILIES:
        drawn = 0
        while drawn < per_family:
            task = family(rng)
            if is_held_out(task.question):
                tasks.append(task)
                drawn += 1
    return tasks


def held_out_tool_cases(seed: int, count: int) -> list[ToolCase]:
    """Requests whose every tool has a held-out name."""
    rng, cases = random.Random(seed + 1), []
    while len(cases) < count:
        case = tool_case(rng)
        if all(is_held_out(t["function"]["name"]) for t in case.tools):
            cases.append(case)
    return cases


def _chat_all(engine: Engine, conversations: list[tuple[list, list | None]]):
    """Engine.chat on every (messages, tools), concurrently so the engine batches them."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(pool.map(lambda c: engine.chat(c[0], tools=c[1], sampling_params=GREEDY),
                             conversations))


def eval_tasks(engine: Engine, tasks: list[Task]) -> dict:
    results = _chat_all(engine, [([{"role": "user", "content": t.question}], None)
                                 for t in tasks])
    report = {}
    for family in dict.fromkeys(t.family for t in tasks):
        rows = [(t, r) for t, r in zip(tasks, results, strict=True) if t.family == family]
        report[family] = dict(
            exact_match=_rate((r.content or "").strip() == t.answer for t, r in rows),
            reasoning_split=_rate(bool(r.reasoning_content) and bool(r.content) for _, r in rows))
    report["exact_match"] = _rate((r.content or "").strip() == t.answer
                                  for t, r in zip(tasks, results, strict=True))
    report["sequences"] = [r.result.prompt_token_ids + r.result.token_ids for r in results]
    report["prompt_lens"] = [len(r.result.prompt_token_ids) for r in results]
    return report


def held_out_images(seed: int, count: int) -> list[ImageTask]:
    rng = random.Random(seed + 2)
    return [image_task(rng) for _ in range(count)]


def held_out_words(seed: int, count: int) -> list[ImageTask]:
    rng = random.Random(seed + 3)
    return [word_task(*rng.sample(list(PALETTE), 2), rng) for _ in range(count)]


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
    engine = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                    skip_kernel_warmup=True)
    try:
        tasks = eval_tasks(engine, held_out_tasks(seed, per_family))
        tools = eval_tool_calls(engine, held_out_tool_cases(seed, num_tools))
        images = eval_images(engine, held_out_images(seed, per_family))
        words = eval_images(engine, held_out_words(seed, per_family))
        prompts = [s[:n] for s, n in zip(tasks["sequences"], tasks["prompt_lens"], strict=True)]
        step = max(1, len(prompts) // num_compare)
        compare = prompts[::step][:num_compare]
        bf16 = bf16_agreement(checkpoint, engine, compare, MAX_TOKENS)
    finally:
        engine.shutdown()
    prompt_lens = tasks.pop("prompt_lens")
    mtp = mtp_agreement(mtp_hits(checkpoint, tasks.pop("sequences")), prompt_lens)
    return dict(tasks=tasks, tools=tools, images=images, words=words, mtp_agreement=mtp,
                bf16_vs_fp32=bf16)


def mtp_acceptance(checkpoint: Path, seed: int, per_family: int, num_steps: int = 1) -> dict:
    """Speculative decoding's real acceptance on the held-out task prompts (greedy, MTP on),
    beside the MTP layer's measured agreement over the same outputs and the acceptance that
    agreement gives on the drafts' schedule (`scheduled_acceptance`; with one draft a step the
    two counts must be equal). Drafting stays on at every step (no acceptance pause, no speed
    check: on the CPU the tiny model decodes faster without drafts, and the check would leave
    only some steps drafted)."""
    engine = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                    skip_kernel_warmup=True, speculative_algorithm="NEXTN",
                    speculative_num_steps=num_steps, speculative_max_batch_size=64,
                    speculative_min_acceptance=0.0, disable_speculative_speed_check=True)
    try:
        tasks = eval_tasks(engine, held_out_tasks(seed, per_family))
        stats = engine.stats().speculative
    finally:
        engine.shutdown()
    hits = mtp_hits(checkpoint, tasks["sequences"])
    report = dict(acceptance_rate=round(stats.acceptance_rate, 4),
                  per_position=[round(a, 4) for a in stats.position_acceptance()],
                  mean_accepted_length=round(stats.mean_accepted_length, 4),
                  num_draft_tokens=stats.num_draft_tokens,
                  num_accepted_tokens=stats.num_accepted_tokens,
                  mtp_agreement=mtp_agreement(hits, tasks["prompt_lens"]))
    if num_steps == 1:
        drafts, accepted = scheduled_acceptance(hits, tasks["prompt_lens"])
        report["agreement_on_the_draft_schedule"] = dict(
            drafts=drafts, accepted=accepted, rate=round(accepted / max(drafts, 1), 4))
    return report


# The indexer's scoring forms `--index-keys` compares: the pooled keys in the model dtype (the
# reference's), as FP8 rows, and FP8 rows scored with e4m3 queries.
INDEX_FORMS = {"auto": dict(index_key_dtype="auto"), "fp8": dict(index_key_dtype="fp8"),
               "fp8_queries": dict(index_key_dtype="fp8", index_query_dtype="fp8")}


def index_keys_check(checkpoint: Path, seed: int, per_family: int) -> dict:
    """The held-out template tasks with each of `INDEX_FORMS`: each one's exact match, and how
    far the FP8 forms' greedy outputs follow the model dtype's (and e4m3 queries' the FP8
    keys')."""
    exact, outputs = {}, {}
    for name, options in INDEX_FORMS.items():
        engine = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                        skip_kernel_warmup=True, **options)
        try:
            report = eval_tasks(engine, held_out_tasks(seed, per_family))
        finally:
            engine.shutdown()
        exact[name] = report["exact_match"]
        outputs[name] = [s[n:] for s, n in zip(report["sequences"], report["prompt_lens"],
                                               strict=True)]
    return dict(exact_match=exact,
                fp8_vs_model_dtype=greedy_agreement(outputs["auto"], outputs["fp8"]),
                fp8_queries_vs_model_dtype=greedy_agreement(outputs["auto"],
                                                            outputs["fp8_queries"]),
                fp8_queries_vs_fp8_keys=greedy_agreement(outputs["fp8"], outputs["fp8_queries"]))


def gpu_agreement(checkpoint: Path, max_tokens: int = GPU_CHECK_TOKENS) -> dict:
    """Greedy tokens of the whole model in bf16 on the GPU (Triton kernels) against the CPU fp32
    reference, on 8 held-out questions and 8 held-out tool requests."""
    chats = [([{"role": "user", "content": t.question}], None) for t in held_out_tasks(2000, 4)]
    chats += [([{"role": "user", "content": c.user}], c.tools)
              for c in held_out_tool_cases(2000, 4)]
    cpu = Engine(checkpoint, device="cpu", dtype="float32", context_length=2048,
                 skip_kernel_warmup=True)
    try:
        prompts = [cpu.tokenizer.encode(cpu.tokenizer.apply_chat_template(m, tools=t))
                   for m, t in chats]
        reference = greedy_outputs(cpu, prompts, max_tokens)
    finally:
        cpu.shutdown()
    gpu = Engine(checkpoint, device="cuda", dtype="bfloat16", context_length=2048)
    try:
        return greedy_agreement(reference, greedy_outputs(gpu, prompts, max_tokens))
    finally:
        gpu.shutdown()


def record_eval(checkpoint: Path, *, gpu_check: bool = False, tar: Path | None = None) -> dict:
    """Evaluate `checkpoint` at the CI sizes, print a table and write the figures into its
    manifest (and `tar`, if given), where tests/tiny/test_trained.py takes its floors."""
    report = evaluate(checkpoint, **CI_SIZES)
    report["sizes"] = CI_SIZES
    _write_eval(checkpoint, report, tar)
    if gpu_check and not torch.cuda.is_available():
        logger.warning("no GPU: the GPU bf16 check is skipped")
    elif gpu_check:
        report["gpu_bf16_vs_cpu_fp32"] = gpu_agreement(checkpoint)
        _write_eval(checkpoint, report, tar)
    print(format_table(report))
    return report


def _write_eval(checkpoint: Path, report: dict, tar: Path | None) -> None:
    manifest = read_manifest(checkpoint)
    manifest["eval"] = report
    (checkpoint / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if tar is not None:
        from tools.tiny_run import write_tar

        write_tar(checkpoint, tar)


def format_table(report: dict) -> str:
    """The eval's figures against issue 16's goals, as a markdown table."""
    tasks, tools = report["tasks"], report["tools"]
    families = " / ".join(f"{tasks[f]['exact_match']:.3f}" for f in ("arithmetic", "copy",
                                                                      "recall"))
    rows = [("exact match, template tasks (arithmetic / copy / recall)",
             f"{tasks['exact_match']:.3f} ({families})", ">= 0.80"),
            ("reasoning split", " / ".join(f"{tasks[f]['reasoning_split']:.2f}" for f in
                                           ("arithmetic", "copy", "recall")), ""),
            ("tool call parsed / right name / right name and arguments",
             f"{tools['tool_call_rate']:.3f} / {tools['right_name']:.3f} / "
             f"{tools['right_call']:.3f}", ">= 0.80 (right call)"),
            ("picture questions", f"{report['images']['exact_match']:.3f}", ""),
            ("words written in pictures", f"{report['words']['exact_match']:.3f}", ""),
            ("MTP top-1 = main model's next-next token", f"{report['mtp_agreement']:.3f}",
             ">= 0.60"),
            ("greedy bf16 vs fp32 on the CPU, positions (identical outputs)",
             _agreement(report["bf16_vs_fp32"]), ">= 0.90")]
    if "gpu_bf16_vs_cpu_fp32" in report:
        rows.append(("greedy GPU bf16 (Triton) vs CPU fp32, positions (identical outputs)",
                     _agreement(report["gpu_bf16_vs_cpu_fp32"]), ">= 0.95"))
    lines = ["| measure | value | goal |", "|---|---|---|"]
    return "\n".join(lines + [f"| {a} | {b} | {c} |" for a, b, c in rows])


def _agreement(figures: dict) -> str:
    return f"{figures['position_agreement']:.3f} ({figures['identical_outputs']:.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--per-family", type=int, default=32)
    parser.add_argument("--tools", type=int, default=48)
    parser.add_argument("--mtp-acceptance", type=int, metavar="STEPS", default=None,
                        help="only measure speculative decoding's acceptance with STEPS drafts")
    parser.add_argument("--index-keys", action="store_true",
                        help="only compare the template tasks with FP8 pooled indexer keys "
                        "(and FP8 keys with e4m3 queries) against the model dtype's")
    parser.add_argument("--record", action="store_true",
                        help="measure at the CI test's sizes and write the figures into the "
                        "checkpoint's manifest (the tests' floors)")
    parser.add_argument("--gpu-check", action="store_true",
                        help="with --record: also greedy bf16 on the GPU against CPU fp32")
    args = parser.parse_args()
    checkpoint = args.checkpoint or embedded_checkpoint()
    if args.mtp_acceptance:
        print(json.dumps(mtp_acceptance(checkpoint, args.seed, args.per_family,
                                        args.mtp_acceptance), indent=2))
        return
    if args.index_keys:
        print(json.dumps(index_keys_check(checkpoint, args.seed, args.per_family), indent=2))
        return
    if args.record:
        record_eval(checkpoint, gpu_check=args.gpu_check)
        return
    report = evaluate(checkpoint, args.seed, args.per_family, args.tools)
    print(json.dumps(report, indent=2))
    print(format_table(report))


if __name__ == "__main__":
    main()
