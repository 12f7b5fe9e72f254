"""Tokenizer layer: tokenizer.json encode/decode, GLM chat template rendering and an
incremental UTF-8-safe detokenizer (spec/chat_api.md §1 and §6)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _BackendTokenizer

logger = logging.getLogger(__name__)

# The 36 added tokens of the GLM-5.x tokenizer, in id order (154820 ... 154855, spec §1.1).
GLM_ADDED_TOKENS: tuple[str, ...] = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>",
    "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
    "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>",
    "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
    "<think>", "</think>", "<tool_call>", "</tool_call>",
    "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
    "<arg_value>", "</arg_value>", "/nothink",
    "<|begin_of_box|>", "<|end_of_box|>", "<|image|>", "<|video|>",
)  # fmt: skip
# Added tokens that are not "special": they survive skip_special_tokens=True.
GLM_NON_SPECIAL_TOKENS: frozenset[str] = frozenset({
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>",
    "</tool_response>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
})  # fmt: skip
# generation_config stop set of GLM-5.3-Flash (spec §1.1).
GLM_STOP_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|user|>", "<|observation|>")
# transformers copies these reasoning field names onto `reasoning_content` before rendering.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """A checkpoint's tokenizer (tokenizer.json via `tokenizers`) plus its chat template."""

    def __init__(
        self,
        backend: _BackendTokenizer,
        config: Mapping[str, Any],
        chat_template: str | None,
        generation_config: Mapping[str, Any] | None = None,
    ) -> None:
        self._backend = backend
        self.chat_template: str | None = chat_template
        self.eos_token: str | None = _token_content(config.get("eos_token"))
        self.pad_token: str | None = _token_content(config.get("pad_token"))
        # Generation stops on any of these: generation_config ids, eos_token, GLM stop tokens.
        self.eos_token_ids: tuple[int, ...] = self._collect_eos_ids(generation_config or {})
        self.pad_token_id: int | None = self._resolve_pad_id(generation_config or {})

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, chat_template.jinja (and the optional
        generation_config.json) from a checkpoint folder."""
        path = Path(path)
        backend = _load_backend(path / "tokenizer.json")
        config = _read_json(path / "tokenizer_config.json")
        template_path = path / "chat_template.jinja"
        if template_path.is_file():
            template, source = template_path.read_text(encoding="utf-8"), template_path
        else:
            template, source = config.get("chat_template"), path / "tokenizer_config.json"
        if template is not None:
            _check_template(template, source)
        generation_config = _read_json(path / "generation_config.json")
        logger.debug("loaded tokenizer from %s (vocab %d)", path, backend.get_vocab_size())
        return cls(backend, config, template, generation_config)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_bytes(self) -> int:
        """Most bytes of text one token stands for (added tokens included): a cheap lower bound
        of a text's token count is its length divided by this."""
        vocab = self._backend.get_vocab(with_added_tokens=True)
        if type(self._backend.decoder).__name__ == "ByteLevel":
            # byte-level tokens spell each byte with one character
            return max(len(token) for token in vocab)
        return max(len(token.encode("utf-8")) for token in vocab)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special tokens, passed to the template as transformers does."""
        names = {"eos_token": self.eos_token, "pad_token": self.pad_token}
        return {key: value for key, value in names.items() if value is not None}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no BOS is added and added tokens are matched literally."""
        return self._backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Normalise OpenAI-style messages and render the prompt text (not tokenized)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        kwargs = {**self.special_tokens_map, **template_kwargs}
        return render_chat_template(
            self.chat_template, normalize_messages(messages), tools, add_generation_prompt, **kwargs
        )

    def _collect_eos_ids(self, generation_config: Mapping[str, Any]) -> tuple[int, ...]:
        configured = generation_config.get("eos_token_id")
        ids = [configured] if isinstance(configured, int) else list(configured or [])
        for token in (self.eos_token, *GLM_STOP_TOKENS):
            token_id = self.token_to_id(token) if token is not None else None
            if token_id is not None:
                ids.append(token_id)
        return tuple(dict.fromkeys(ids))

    def _resolve_pad_id(self, generation_config: Mapping[str, Any]) -> int | None:
        pad_id = self.token_to_id(self.pad_token) if self.pad_token is not None else None
        if pad_id is not None:
            return pad_id
        if isinstance(generation_config.get("pad_token_id"), int):
            return generation_config["pad_token_id"]
        return self.eos_token_ids[0] if self.eos_token_ids else None


def normalize_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Fix OpenAI-style messages for the GLM template (spec §6 item 2): `developer` becomes
    `system`, `content: None` becomes "", tool-call `arguments` JSON strings become dicts and
    `reasoning` is accepted as `reasoning_content`. The input is not modified."""
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"message {index} is not an object: {message!r}")
        normalized.append(_normalize_message(dict(message), index))
    return normalized


def _normalize_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    if message.get("role") == "developer":
        message["role"] = "system"
    if "content" in message and message["content"] is None:
        message["content"] = ""
    reasoning = message.pop("reasoning", None)
    if message.get("reasoning_content") is None and reasoning is not None:
        message["reasoning_content"] = reasoning
    if message.get("tool_calls"):
        message["tool_calls"] = [_normalize_tool_call(c, index) for c in message["tool_calls"]]
    return message


def _normalize_tool_call(call: Any, index: int) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise ValueError(f"message {index}: a tool call is not an object: {call!r}")
    call = dict(call)
    # OpenAI nests {name, arguments} under "function"; the flat form is accepted too.
    holder = dict(call["function"]) if isinstance(call.get("function"), Mapping) else call
    if "arguments" in holder:
        holder["arguments"] = _parse_arguments(holder["arguments"], index)
    if holder is not call:
        call["function"] = holder
    return call


def _parse_arguments(arguments: Any, index: int) -> Any:
    if arguments is None or isinstance(arguments, Mapping):
        return arguments
    if not isinstance(arguments, str):
        raise ValueError(f"message {index}: tool call arguments must be a JSON object")
    # NOTE: some clients send "" for a call without arguments; treat it as {}.
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except (json.JSONDecodeError, RecursionError) as exc:  # nesting past the parser's stack
        raise ValueError(f"message {index}: tool call arguments are not valid JSON: {exc}") from exc
    if not isinstance(parsed, dict):
        raise ValueError(f"message {index}: tool call arguments must be a JSON object")
    return parsed


def render_chat_template(
    template_str: str,
    messages: list[Mapping[str, Any]],
    tools: list[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render a chat template exactly as transformers 5.x `apply_chat_template(tokenize=False)`
    does: None-valued message keys dropped, reasoning fields aliased, then sandboxed Jinja with
    trim/lstrip blocks, loopcontrols and a json.dumps `tojson`."""
    template = _compile_template(template_str)
    return template.render(
        messages=[_alias_reasoning(_drop_none(m)) for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=add_generation_prompt,
        **kwargs,
    )


def _drop_none(message: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if value is not None}


def _alias_reasoning(message: Mapping[str, Any]) -> Mapping[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _check_template(template: Any, source: Path) -> None:
    """Compile the chat template at load (ValueError naming its file), not at the first chat
    request, which would fail every one."""
    if not isinstance(template, str):
        raise ValueError(f"{source}: the chat template must be a string")
    try:
        _compile_template(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"{source}: invalid chat template (line {exc.lineno}: {exc.message})") \
            from None


@lru_cache(maxsize=8)
def _compile_template(template_str: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template_str)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class IncrementalDetokenizer:
    """Per-sequence streaming decode that never emits a partial UTF-8 character.

    Byte-level BPE can split a character across ids; the unfinished tail decodes to U+FFFD and
    is held back. Each step decodes only a short window: `_window[:_num_prefix]` are the ids of
    the last finished chunk (context, text `_prefix_text`), the rest are pending, and
    `_offset` counts the characters of decode(window) already emitted.
    NOTE: text before the last complete character never changes as bytes are appended, and
    the window always starts on a character boundary, so emitted pieces concatenate to the full
    decode.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []
        self._num_prefix = 0
        self._prefix_text = ""
        self._offset = 0

    def add(self, token_ids: Iterable[int]) -> str:
        """Append ids; return the newly completed text (possibly "")."""
        self._window.extend(token_ids)
        text = self._decode_window()
        stable_len = len(text.rstrip(_REPLACEMENT_CHAR))
        new_text = text[self._offset : stable_len]
        self._offset = max(self._offset, stable_len)
        if stable_len == len(text):
            self._start_window_at_end(text)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (incomplete bytes decode to U+FFFD) and reset."""
        new_text = self._decode_window()[self._offset :]
        self._window, self._num_prefix, self._prefix_text, self._offset = [], 0, "", 0
        return new_text

    def _start_window_at_end(self, text: str) -> None:
        # The pending ids end on a character boundary: they become the next window's context.
        self._window = self._window[self._num_prefix :]
        self._num_prefix = len(self._window)
        self._prefix_text = text[len(self._prefix_text) :]
        self._offset = len(self._prefix_text)

    def _decode_window(self) -> str:
        return self._tokenizer.decode(self._window, skip_special_tokens=self._skip_special_tokens)


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):
        return token.get("content")
    return token if isinstance(token, str) else None


def _load_backend(path: Path) -> _BackendTokenizer:
    """The `tokenizers` object of tokenizer.json; a missing or unreadable file names itself."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; the checkpoint folder needs its tokenizer")
    try:
        return _BackendTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception
        raise ValueError(f"{path} is not a valid tokenizer file ({exc})") from None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with path.open(encoding="utf-8") as f:
            value = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value
