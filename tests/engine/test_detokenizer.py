"""The stop-string hold-back of `SequenceDetokenizer`: the longest tail of the text that a stop
string starts with (held back until the next tokens say whether the stop follows)."""

from __future__ import annotations

import random
import time

from glmflash.engine.detokenizer import SequenceDetokenizer


def _detokenizer(text: str, stops: list[str]) -> SequenceDetokenizer:
    detok = SequenceDetokenizer.__new__(SequenceDetokenizer)  # the text side alone
    detok.stops, detok.text, detok.num_emitted = stops, text, 0
    return detok


def _held_back_by_definition(text: str, stops: list[str]) -> int:
    return max((k for stop in stops for k in range(1, len(stop))
                if k <= len(text) and text.endswith(stop[:k])), default=0)


def test_the_longest_tail_a_stop_string_starts_with():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 8)))
                 for _ in range(rng.randrange(1, 4))]
        assert _detokenizer(text, stops)._held_back() == _held_back_by_definition(text, stops)


def test_long_stop_strings_cost_a_scan_not_a_slice_per_length():
    """Four stop strings longer than a 32K-character output: each token's check scans the
    tail once (a slice per prefix length took 55 ms a token here)."""
    detok = _detokenizer("y" * 32_000, ["z" * 200_000] * 4)
    start = time.perf_counter()
    assert detok._held_back() == 0
    assert time.perf_counter() - start < 0.02
