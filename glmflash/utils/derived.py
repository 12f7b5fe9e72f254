"""Values derived from a module's weights (a dequantised copy, an fp32 copy, a stacked
filter), made once and kept while the weights they come from stay where they are. Keys are
data pointers: a weight updated in place keeps its stale copy (inference weights are not)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

T = TypeVar("T")


def kept(owner: object, name: str, key: Hashable, make: Callable[[], T]) -> T:
    """`make()`, kept on `owner` under `name` and made again when `key` changes (the data
    pointers of its sources, and whatever else the value depends on)."""
    store = owner.__dict__.setdefault("_kept_values", {})
    entry = store.get(name)
    if entry is None or entry[0] != key:
        entry = (key, make())
        store[name] = entry
    return entry[1]
