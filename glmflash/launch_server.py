"""`python -m glmflash.launch_server [flags]`: the OpenAI-compatible server (same flags as
`glmflash serve`)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from glmflash.utils.env import configure_openmp

    configure_openmp()
    from glmflash.server.args import build_parser
    from glmflash.server.launch import run_server

    return run_server(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
