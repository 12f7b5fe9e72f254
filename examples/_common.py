"""What the examples share: the server address and model name from the command line."""

from __future__ import annotations

import argparse

DEFAULT_BASE_URL = "http://localhost:30000/v1"


def parse_args(description: str, argv: list[str] | None = None,
               extra: callable | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL,
                        help="the server's OpenAI base URL (glmflash serve listens on 30000)")
    parser.add_argument("--api-key", default="unused", help="the server's --api-key, if any")
    parser.add_argument("--model", default=None, help="served model name (default: the first)")
    if extra is not None:
        extra(parser)
    return parser.parse_args(argv)


def first_model(client) -> str:
    return client.models.list().data[0].id
