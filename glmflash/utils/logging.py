"""Logging set-up: one stdlib logger per module, configured once by the CLI or the Engine."""

from __future__ import annotations

import logging

from glmflash.utils.env import log_level

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def setup_logging(level: str | None = None) -> None:
    """Attach a stderr handler to the `glmflash` logger if none is attached yet."""
    root = logging.getLogger("glmflash")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        root.addHandler(handler)
    root.setLevel(level or log_level())
