"""Typed reads from a request's JSON objects; every failure is a 400 naming the field (`param`).

JSON `null` counts as absent (the field's default), as in OpenAI's API.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from glmflash.server.errors import bad_request

# Integers past 2**53 lose precision as floats (and 10**400 does not convert at all).
_MAX_EXACT_INT = 2**53


class Fields:
    """One JSON object of a request; `path` prefixes `param` in errors (e.g. `messages[2].`)."""

    def __init__(self, raw: Any, path: str = "") -> None:
        if not isinstance(raw, dict):
            raise bad_request(f"'{path.rstrip('.') or 'body'}' must be a JSON object",
                              param=path.rstrip(".") or None)
        self.raw = raw
        self.path = path

    def has(self, name: str) -> bool:
        return self.raw.get(name) is not None

    def param(self, name: str) -> str:
        return f"{self.path}{name}"

    def fail(self, name: str, message: str) -> Exception:
        return bad_request(f"'{self.param(name)}' {message}", param=self.param(name))

    def get(self, name: str, types: tuple[type, ...], what: str, default: Any = None, *,
            required: bool = False) -> Any:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise self.fail(name, "is required")
            return default
        # NOTE: bool is an int subclass; a JSON true is never accepted as a number.
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise self.fail(name, f"must be {what}, got {_json_type(value)}")
        return value

    def string(self, name: str, default: str | None = None, *, required: bool = False,
               choices: Collection[str] | None = None) -> str | None:
        value = self.get(name, (str,), "a string", default, required=required)
        if choices is not None and value is not None and value not in choices:
            raise self.fail(name, f"must be one of {sorted(choices)}, got {value!r}")
        return value

    def integer(self, name: str, default: int | None = None, *, lo: int | None = None,
                hi: int | None = None) -> int | None:
        value = self.get(name, (int,), "an integer", default)
        return self._in_range(name, value, lo, hi)

    def number(self, name: str, default: float | None = None, *, lo: float | None = None,
               hi: float | None = None) -> float | None:
        value = self.get(name, (int, float), "a number", default)
        if value is None:
            return None
        # NOTE: Python's JSON reader accepts NaN, Infinity and 1e999 (inf); none is a number here.
        if isinstance(value, float) and not math.isfinite(value) or \
                isinstance(value, int) and abs(value) > _MAX_EXACT_INT:
            raise self.fail(name, f"must be a finite number, got {value!r:.40}")
        return self._in_range(name, float(value), lo, hi)

    def boolean(self, name: str, default: bool = False) -> bool:
        return self.get(name, (bool,), "a boolean", default)

    def array(self, name: str, default: list | None = None, *, required: bool = False) -> list:
        return self.get(name, (list,), "an array", default, required=required)

    def object(self, name: str, *, required: bool = False) -> Fields | None:
        value = self.get(name, (dict,), "an object", required=required)
        return None if value is None else Fields(value, f"{self.param(name)}.")

    def _in_range(self, name: str, value: Any, lo: float | None, hi: float | None) -> Any:
        if value is None:
            return None
        if lo is not None and value < lo or hi is not None and value > hi:
            bounds = f"[{lo}, {hi}]" if lo is not None and hi is not None else \
                (f">= {lo}" if lo is not None else f"<= {hi}")
            raise self.fail(name, f"must be {bounds}, got {value}")
        return value


def _json_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return names.get(type(value), type(value).__name__)
