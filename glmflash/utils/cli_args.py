"""argparse pieces both commands share: a one-line error, every default in --help, value types."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, NoReturn

# argparse's own status for a usage error.
EXIT_USAGE = 2
# What `chunk_size` gives for "no limit": larger than any prompt.
UNLIMITED = 2**31 - 1
MAX_PORT = 65535


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): `prog: error: message (see --help)`."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, flags without a help text included."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text or \
                not action.option_strings:
            return action.help
        return f"{text} (default: %(default)s)".lstrip()


def positive_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _parse(int, text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = _parse(float, text, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _parse(float, text, "a number")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port (getaddrinfo would wrap a larger one: 70000 binds port 4464)."""
    value = _parse(int, text, "an integer")
    if not 1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be in 1..{MAX_PORT}, got {value}")
    return value


def secret(text: str) -> str:
    """A key clients send in an HTTP header: not empty (`--api-key "$KEY"` with KEY unset),
    and without surrounding whitespace, which a header value cannot carry (no client could
    match the key)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "must not be empty" if not text else "must not be only whitespace")
    if text != text.strip():
        raise argparse.ArgumentTypeError("must not start or end with whitespace (an HTTP header "
                                         "cannot carry it, so no client could match the key)")
    return text


def fraction(text: str) -> float:
    """A value in (0, 1]: a share of device memory, or top-p (`probability`)."""
    value = _parse(float, text, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def chunk_size(text: str) -> int:
    """A token count, or -1 (also 0) for no limit (SGLang's spelling of "no chunking")."""
    value = _parse(int, text, "an integer")
    if value in (-1, 0):
        return UNLIMITED
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or -1 for no chunking), got {value}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


probability = fraction


def _parse(kind: type, text: str, what: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value
