"""lm-evaluation-harness against glmflash: a log-likelihood multiple-choice task (the way MMLU,
HellaSwag or ARC are scored) through lm-eval's `local-completions` model, which sends `echo` +
`logprobs` requests to /v1/completions and reads the prompt log-probabilities.

    pip install 'glmflash[examples]'
    python examples/lm_eval_local.py --base-url http://localhost:30000/v1 --limit 6

The task is a six-question file beside this script (examples/data/tiny_mc.jsonl). The same
command line works with the lm_eval CLI:
    lm_eval --model local-completions --model_args model=NAME,base_url=URL/completions,\
tokenizer=MODEL_DIR --include_path DIR_WITH_THE_YAML --tasks glmflash_tiny_mc
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import openai
from _common import first_model, parse_args

DATA = Path(__file__).resolve().parent / "data" / "tiny_mc.jsonl"
TASK = "glmflash_tiny_mc"
TASK_YAML = """task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def _options(parser) -> None:
    parser.add_argument("--tokenizer", default=None,
                        help="a local model folder or HF name with the tokenizer (default: the "
                        "server's model folder, from /v1/models)")
    parser.add_argument("--limit", type=int, default=None, help="questions to score")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, extra=_options)
    import lm_eval
    from lm_eval.tasks import TaskManager

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or first_model(client)
    tokenizer = args.tokenizer or client.models.retrieve(model).model_extra["root"]
    with tempfile.TemporaryDirectory() as task_dir:
        Path(task_dir, f"{TASK}.yaml").write_text(TASK_YAML.format(task=TASK, data=DATA))
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={"model": model, "base_url": f"{args.base_url}/completions",
                        "tokenizer": tokenizer, "num_concurrent": 1, "max_retries": 1},
            tasks=[TASK], task_manager=TaskManager(include_path=task_dir), limit=args.limit)
    scores = results["results"][TASK]
    print(f"{TASK}: acc {scores['acc,none']:.3f} over {args.limit or 'all'} questions")
    return scores


if __name__ == "__main__":
    main()
