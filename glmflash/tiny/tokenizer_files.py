"""The tiny tokenizer of the embedded test checkpoint: a byte-level BPE trained on an original
corpus, plus the 36 GLM added tokens in their real order (spec/chat_api.md §1.1)."""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from glmflash.tokenizer import GLM_ADDED_TOKENS, GLM_NON_SPECIAL_TOKENS

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
# The real model's nominal context (spec/model.md max_position_embeddings).
MODEL_MAX_LENGTH = 1_048_576


def write_tiny_tokenizer(out_dir: Path, *, base_vocab_size: int = 1024) -> dict[str, int]:
    """Train the tiny BPE and write tokenizer.json, tokenizer_config.json and
    chat_template.jinja into `out_dir`; the output is byte-identical across runs.

    Returns the id of each of the 36 added tokens (base_vocab_size ... base_vocab_size + 35).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tiny_bpe(base_vocab_size)
    added_ids = _add_glm_tokens(tokenizer)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(added_ids))
    (out_dir / "chat_template.jinja").write_bytes(_asset_bytes("chat_template.jinja"))
    logger.debug("wrote tiny tokenizer (%d ids) to %s", tokenizer.get_vocab_size(), out_dir)
    return added_ids


def train_tiny_bpe(vocab_size: int) -> Tokenizer:
    """Byte-level BPE with exactly `vocab_size` ids, trained on assets/tiny_corpus.txt."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = _asset_bytes("tiny_corpus.txt").decode("utf-8")
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tiny corpus supports {tokenizer.get_vocab_size()} ids, not {vocab_size}"
        )
    return tokenizer


def _add_glm_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    # One call per token keeps the real id order across special and non-special tokens.
    for content in GLM_ADDED_TOKENS:
        is_special = content not in GLM_NON_SPECIAL_TOKENS
        token = AddedToken(content, special=is_special, normalized=False)
        if is_special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    ids = {content: tokenizer.token_to_id(content) for content in GLM_ADDED_TOKENS}
    base = tokenizer.get_vocab_size(with_added_tokens=False)
    assert list(ids.values()) == list(range(base, base + len(GLM_ADDED_TOKENS))), ids
    return ids


def _tokenizer_config(added_ids: dict[str, int]) -> dict[str, Any]:
    decoder = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": content not in GLM_NON_SPECIAL_TOKENS,
        }
        for content, token_id in added_ids.items()
    }
    return {
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": EOS_TOKEN,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def _asset_bytes(name: str) -> bytes:
    return resources.files("glmflash").joinpath("assets").joinpath(name).read_bytes()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
