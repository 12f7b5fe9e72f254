"""`glmflash serve | generate | make-tiny`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from glmflash.engine.options import LOAD_FORMATS
from glmflash.utils.env import configure_openmp
from glmflash.utils.logging import setup_logging


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glmflash", description="GLM-5.3-Flash inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    from glmflash.server.args import add_server_args

    add_server_args(sub.add_parser("serve", help="run the OpenAI-compatible server",
                                   description="OpenAI-compatible GLM-5.3-Flash server",
                                   allow_abbrev=False))
    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model-path", default=None,
                     help="checkpoint folder (default: the embedded tiny checkpoint)")
    gen.add_argument("--prompt", action="append", required=True,
                     help="prompt text; repeat for several prompts")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message through the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--dtype", default=None, help="float32 or bfloat16")
    gen.add_argument("--load-format", choices=LOAD_FORMATS, default=None,
                     help="dummy: seeded random weights made in memory (no safetensors needed)")
    tiny = sub.add_parser("make-tiny", help="write the tiny random checkpoint")
    tiny.add_argument("dir", nargs="?", default=None,
                      help="output folder (default: the embedded checkpoint's cache folder)")
    tiny.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    configure_openmp()
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from glmflash.server.launch import run_server

        return run_server(args)
    setup_logging()
    from glmflash.model.weights import CheckpointError

    try:
        return _make_tiny(args) if args.command == "make-tiny" else _generate(args)
    except (ValueError, CheckpointError, OSError) as exc:
        logging.getLogger("glmflash.cli").error("%s", exc)
        return 2


def _make_tiny(args: argparse.Namespace) -> int:
    if args.dir is None:
        from glmflash.tiny.embedded import embedded_checkpoint

        path = embedded_checkpoint(args.seed)
    else:
        from glmflash.tiny.checkpoint import make_tiny_checkpoint

        path = make_tiny_checkpoint(Path(args.dir), seed=args.seed)
    sys.stdout.write(f"{path}\n")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from glmflash.engine.engine import Engine
    from glmflash.sampling_params import SamplingParams

    engine = Engine(args.model_path, device=args.device, dtype=args.dtype,
                    load_format=args.load_format)
    prompts = args.prompt
    if args.chat:
        prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    for result in engine.generate(prompts, params):
        sys.stdout.write(result.text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
