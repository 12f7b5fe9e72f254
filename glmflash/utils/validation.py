"""One way to validate user-facing options: a list of (condition, message) pairs."""

from __future__ import annotations

from collections.abc import Iterable


def require(checks: Iterable[tuple[bool, str]], error: type[Exception] = ValueError) -> None:
    """Raise `error(message)` for the first failed condition."""
    for ok, message in checks:
        if not ok:
            raise error(message)
