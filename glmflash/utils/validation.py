"""One way to validate user-facing options: a list of (condition, message) pairs."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


def require(checks: Iterable[tuple[bool, str]], error: type[Exception] = ValueError) -> None:
    """Raise `error(message)` for the first failed condition."""
    for ok, message in checks:
        if not ok:
            raise error(message)


def is_integer(value: Any) -> bool:
    """An integer, not a bool (Python's bools are ints; a user's `true` is not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
