"""Token deltas -> text deltas, UTF-8 safe, with stop strings that never leak partially."""

from __future__ import annotations

from dataclasses import dataclass

from glmflash.engine.sequence import Sequence
from glmflash.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(slots=True)
class TextDelta:
    text: str
    hit_stop_string: bool


class SequenceDetokenizer:
    """Per sequence: decoded text so far, and how much of it has been emitted."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence) -> None:
        self.decoder = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=seq.params.skip_special_tokens)
        self.stops = seq.params.stop
        self.text = ""
        self.num_emitted = 0

    def add(self, token_ids: list[int], *, is_last: bool) -> TextDelta:
        """Decode new tokens and emit what is safe.

        Exclude a terminating stop token from `token_ids` before calling.
        """
        self.text += self.decoder.add(token_ids)
        if is_last:
            self.text += self.decoder.flush()
        cut = self._first_stop()
        if cut is not None:
            self.text = self.text[:cut]
            return TextDelta(self._emit(len(self.text)), True)
        safe = len(self.text) if is_last else len(self.text) - self._held_back()
        return TextDelta(self._emit(safe), False)

    def add_run(self, token_ids: list[int], *, is_last: bool) -> tuple[TextDelta, int]:
        """`add` one token at a time (a verify step brings several): the text up to the token
        that completes a stop string, and how many tokens were taken."""
        if len(token_ids) <= 1:
            return self.add(token_ids, is_last=is_last), len(token_ids)
        pieces = []
        for i, token in enumerate(token_ids):
            delta = self.add([token], is_last=is_last and i == len(token_ids) - 1)
            pieces.append(delta.text)
            if delta.hit_stop_string:
                return TextDelta("".join(pieces), True), i + 1
        return TextDelta("".join(pieces), False), len(token_ids)

    def _emit(self, upto: int) -> str:
        upto = max(upto, self.num_emitted)
        out = self.text[self.num_emitted: upto]
        self.num_emitted = upto
        return out

    def _first_stop(self) -> int | None:
        # A stop string can only newly appear in the unemitted tail (plus its own length).
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.num_emitted - longest + 1)
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail that is a proper prefix of some stop string: the first
        position of the last `len(stop) - 1` characters holding the stop's first character
        from which the rest of the text starts the stop (a scan, not a slice per length)."""
        best, text = 0, self.text
        for stop in self.stops:
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1))
            while i >= 0 and len(text) - i > best:
                if stop.startswith(text[i:]):
                    best = len(text) - i
                    break
                i = text.find(stop[0], i + 1)
        return best
