"""`glmflash serve | generate | make-tiny`: the command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from glmflash.utils import env
from glmflash.utils.cli_args import (
    ArgumentParser,
    HelpFormatter,
    non_negative_float,
    non_negative_int,
    positive_int,
    probability,
)
from glmflash.utils.logging import setup_logging
from glmflash.utils.preflight import check_device, check_model_path, run_reporting_errors

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    from glmflash import __version__
    from glmflash.server.args import add_engine_args, add_model_args, add_server_args

    parser = ArgumentParser(prog="glmflash", description="GLM-5.3-Flash inference engine")
    parser.add_argument("--version", action="version", version=f"glmflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_server_args(sub.add_parser("serve", help="run the OpenAI-compatible server",
                                   description="OpenAI-compatible GLM-5.3-Flash server",
                                   formatter_class=HelpFormatter, allow_abbrev=False))
    gen = sub.add_parser("generate", help="generate text from a prompt",
                         formatter_class=HelpFormatter)
    gen.add_argument("--prompt", action="append", required=True,
                     help="prompt text; repeat for several prompts")
    gen.add_argument("--chat", action="store_true",
                     help="wrap each prompt as a user message through the chat template")
    gen.add_argument("--max-tokens", type=positive_int, default=128, help="most tokens per prompt")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="keep generating past end-of-sequence tokens (up to --max-tokens)")
    gen.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=probability, default=1.0, help="nucleus mass, in (0, 1]")
    gen.add_argument("--top-k", type=non_negative_int, default=0, help="0: no top-k cut")
    gen.add_argument("--debug", action="store_true", help="show the traceback of an error")
    model = gen.add_argument_group("model")
    add_model_args(model)
    # --seed is the engine's default sampling seed, so it seeds these prompts too.
    add_engine_args(gen, {"model": model})
    tiny = sub.add_parser("make-tiny", help="write the tiny random checkpoint",
                          formatter_class=HelpFormatter)
    tiny.add_argument("dir", nargs="?", default=None,
                      help="output folder (default: the random checkpoint's cache folder)")
    tiny.add_argument("--seed", type=int, default=0, help="weights seed")
    tiny.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    env.configure_openmp()
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        from glmflash.server.launch import run_server

        return run_server(args)
    from glmflash.engine.errors import STARTUP_ERRORS

    command = _make_tiny if args.command == "make-tiny" else _generate

    def run() -> int:
        # GLMFLASH_LOG_LEVEL is read here: a bad value is one line like any other error.
        setup_logging()
        return command(args)

    return run_reporting_errors(run, debug=args.debug, usage_errors=STARTUP_ERRORS)


def _make_tiny(args: argparse.Namespace) -> int:
    if args.dir is None:
        from glmflash.tiny.embedded import random_tiny_checkpoint

        path = random_tiny_checkpoint(args.seed)
    else:
        from glmflash.tiny.checkpoint import make_tiny_checkpoint

        path = make_tiny_checkpoint(Path(args.dir), seed=args.seed)
    sys.stdout.write(f"{path}\n")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from glmflash.sampling_params import SamplingParams

    # Every flag is checked before the model loads (minutes for the release checkpoint).
    from glmflash.server.args import engine_options, inapplicable_flags

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    env.check()
    check_device(args.device)
    check_model_path(args.model_path)
    import torch

    from glmflash.engine.engine import Engine

    engine = Engine(args.model_path, device=args.device, dtype=args.dtype,
                    **engine_options(args, for_server=False))
    try:
        # As `serve` does: one line per flag that has no effect on this device.
        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        for line in inapplicable_flags(args, engine.device.type, num_gpus, engine.supports_media,
                                       for_server=False):
            logger.warning("%s", line)
        prompts = args.prompt
        if args.chat:
            prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}])
                       for p in prompts]
        for result in engine.generate(prompts, params):
            sys.stdout.write(result.text + "\n")
    finally:
        # Also on Ctrl-C and errors: the other ranks of a split model stop with this one.
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
