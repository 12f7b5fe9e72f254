"""Log-probabilities in OpenAI's two shapes: chat (`token`, `logprob`, `bytes`, `top_logprobs`)
and legacy completions (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from collections.abc import Collection
from functools import lru_cache
from typing import Any

from glmflash.tokenizer import IncrementalDetokenizer, Tokenizer

# JSON has no -Infinity; a token the model rules out reports this instead.
MIN_LOGPROB = -9999.0
_REPLACEMENT_CHAR = "\ufffd"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: byte-level BPE piece characters -> raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Per-token display text and UTF-8 bytes, cached by id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._cache:
            text = self.tokenizer.decode([token_id])
            self._cache[token_id] = (text, self._raw_bytes(token_id, text))
        return self._cache[token_id]

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        if _REPLACEMENT_CHAR not in text:
            return list(text.encode("utf-8"))
        # A piece of a multi-byte character: its bytes come from the byte-level BPE piece.
        piece = self.tokenizer.id_to_token(token_id) or ""
        decoder = _byte_decoder()
        if piece and all(c in decoder for c in piece):
            return [decoder[c] for c in piece]
        return list(text.encode("utf-8"))


class TokenPieces:
    """The text each token adds to its choice's decode, so that a choice's logprob tokens join
    to its text: a token ending inside a multi-byte character adds "" and the token that
    completes the character adds all of it; a stop token that ended the choice adds ""."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool,
                 stop_token_ids: Collection[int] = ()) -> None:
        self.decoder = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop_token_ids = stop_token_ids

    def pieces(self, token_ids: list[int], finish_reason: str | None = None) -> list[str]:
        """Pieces of the next tokens; `finish_reason` once they end the choice."""
        ends_on_stop_token = finish_reason == "stop" and bool(token_ids) and \
            token_ids[-1] in self.stop_token_ids
        shown = token_ids[:-1] if ends_on_stop_token else token_ids
        out = [self.decoder.add([token_id]) for token_id in shown]
        if ends_on_stop_token:
            out.append("")
        if finish_reason is not None and out:
            out[-1] += self.decoder.flush()
        return out

    def whole(self, token_ids: list[int]) -> list[str]:
        """Pieces of a complete text's tokens (an echoed prompt)."""
        out = [self.decoder.add([token_id]) for token_id in token_ids]
        if out:
            out[-1] += self.decoder.flush()
        return out


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(logprobs: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda item: -item[1])[:k]


def chat_logprobs(texts: TokenText, pieces: list[str], token_ids: list[int],
                  logprobs: list[dict[int, float]], k: int) -> list[dict[str, Any]]:
    """`choices[].logprobs.content` entries for these tokens (`pieces`: their TokenPieces)."""
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        return {"token": texts.text(token_id), "logprob": _value(logprob),
                "bytes": texts.bytes(token_id)}

    return [{**entry(t, lp[t]), "token": piece,
             "top_logprobs": [entry(i, v) for i, v in _top(lp, k)]}
            for piece, t, lp in zip(pieces, token_ids, logprobs, strict=True)]


class CompletionLogprobs:
    """Accumulates one completion choice's `logprobs` object; offsets count characters.

    `top_logprobs` holds the k most likely tokens plus the chosen one (so `logprobs: 0` still
    names it); a prompt's first token has null logprob and top_logprobs.
    """

    def __init__(self, texts: TokenText, k: int, offset: int = 0) -> None:
        self.texts = texts
        self.k = k
        self.offset = offset
        self.data: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}

    def add(self, pieces: list[str], token_ids: list[int],
            logprobs: list[dict[int, float] | None]) -> dict[str, list]:
        """Append tokens; returns the object for just these tokens (a streaming chunk's)."""
        part: dict[str, list] = {key: [] for key in self.data}
        for piece, token_id, lp in zip(pieces, token_ids, logprobs, strict=True):
            part["tokens"].append(piece)
            part["token_logprobs"].append(None if lp is None else _value(lp[token_id]))
            part["top_logprobs"].append(None if lp is None else self._top(token_id, lp))
            part["text_offset"].append(self.offset)
            self.offset += len(piece)
        for key, values in part.items():
            self.data[key] += values
        return part

    def _top(self, token_id: int, logprobs: dict[int, float]) -> dict[str, float]:
        top = dict(_top(logprobs, self.k))
        top[token_id] = logprobs[token_id]
        return {self.texts.text(i): _value(v) for i, v in _top(top, len(top))}
