"""The training data of the trained tiny model: a deterministic mixture (from a seed) of plain
text and chat transcripts rendered with the checkpoint's own chat template.

A sample is token ids plus a 0/1 mask of the assistant tokens (plain text: all of it; chats: from
after `<|assistant|>` up to and including the stop token that ends the turn, `<|user|>` or
`<|observation|>`), and the pixels of its pictures if it has any.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from glmflash.config import ModelConfig
from glmflash.multimodal.image import ImageInputs
from glmflash.multimodal.prompt import prepare_multimodal_prompt
from glmflash.tokenizer import Tokenizer
from tools.tiny_tasks import QA_FAMILIES, Task, greeting, story
from tools.tiny_tool_tasks import ToolCase, tool_case, tool_conversation
from tools.tiny_vision_tasks import ImageTask, image_task

EOS = "<|endoftext|>"
HELD_OUT_MODULUS = 8
END_OF_TURN = "<|user|>"
# family -> share of the samples
MIXTURE = {"greeting": 0.06, "story": 0.08, "raw_qa": 0.08, "chat_qa": 0.34, "tool": 0.34,
           "image": 0.10}
RECIPE_1 = ("plain text (greetings, short stories, 'Q: ... A: ...' lines), chat transcripts "
          "with <think> reasoning (arithmetic on 0-9, copying 2-4 words, recalling a colour from "
          "two facts; 30% after an earlier turn), tool use on generated schemas (1-2 tools with "
          "random names, 1-2 parameters of random name and type; call, tool result, final answer), "
          "pictures (pillow: a square, circle or triangle of one colour on another) with a "
          "question on the shape, its colour or the background")
RECIPES = {1: RECIPE_1,
           2: RECIPE_1 + "; a quarter of the pictures show a word (one of 12) to read instead"}
RECIPE_VERSION = 2
"""The data recipe of new runs (a manifest records its run's; without one: recipe 1)."""


@dataclass
class Sample:
    ids: list[int]
    mask: list[int]
    image_inputs: ImageInputs | None = None
    """Pixels of the sample's pictures, whose expanded `<|image|>` tokens are in `ids`."""


class SampleMaker:
    """Renders and tokenizes samples with a checkpoint folder's tokenizer and template."""

    def __init__(self, tokenizer_dir: str | Path, config: ModelConfig,
                 recipe: int = RECIPE_VERSION) -> None:
        if recipe not in RECIPES:
            raise ValueError(f"unknown data recipe {recipe}; known: {sorted(RECIPES)}")
        self.recipe = recipe
        self.tokenizer = Tokenizer.from_dir(tokenizer_dir)
        self.backend = BackendTokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        self.config = config

    def plain(self, text: str) -> Sample:
        ids = self.backend.encode(text + EOS, add_special_tokens=False).ids
        return Sample(ids, [1] * len(ids))

    def chat(self, messages: list[dict[str, Any]], tools: list | None = None) -> Sample:
        text = self.tokenizer.apply_chat_template(messages, tools=tools,
                                                  add_generation_prompt=False) + END_OF_TURN
        spans = [(m.end(), _turn_end(text, m.end()))
                 for m in re.finditer(re.escape("<|assistant|>"), text)]
        encoding = self.backend.encode(text, add_special_tokens=False)
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding.offsets]
        return Sample(encoding.ids, mask)

    def image_chat(self, task: ImageTask) -> Sample:
        """A question on a picture; its placeholder expanded as the engine expands it."""
        user = {"role": "user", "content": [{"type": "image"},
                                            {"type": "text", "text": task.question}]}
        sample = self.chat([user, {"role": "assistant", "content": task.answer,
                                   "reasoning_content": task.reasoning}])
        prompt = prepare_multimodal_prompt(sample.ids, config=self.config,
                                           tokenizer=self.tokenizer, images=[task.image])
        at = sample.ids.index(self.config.image_token_id)
        extra = len(prompt.token_ids) - len(sample.ids)
        assert prompt.token_ids[:at] == sample.ids[:at]
        assert prompt.token_ids[at + extra + 1:] == sample.ids[at + 1:]
        mask = sample.mask[:at] + [0] * extra + sample.mask[at:]
        return Sample(prompt.token_ids, mask, prompt.image_inputs)


def _turn_end(text: str, start: int) -> int:
    ends = [i + len(t) for t in (END_OF_TURN, "<|observation|>") if (i := text.find(t, start)) >= 0]
    return min(ends) if ends else len(text)


def qa_messages(task: Task) -> list[dict[str, Any]]:
    return [{"role": "user", "content": task.question},
            {"role": "assistant", "content": task.answer, "reasoning_content": task.reasoning}]


def is_held_out(text: str) -> bool:
    """The fixed eighth of questions and tool names kept for the eval: training never draws
    them (a stable hash, the same in every process)."""
    return zlib.crc32(text.encode()) % HELD_OUT_MODULUS == 0


def random_task(rng: random.Random) -> Task:
    """A training question (never a held-out one)."""
    while is_held_out((task := rng.choice(QA_FAMILIES)(rng)).question):
        pass
    return task


def training_tool_case(rng: random.Random) -> ToolCase:
    """A tool-use request whose tool names are none of the held-out ones."""
    while True:
        case = tool_case(rng)
        if not any(is_held_out(t["function"]["name"]) for t in case.tools):
            return case


def make_sample(maker: SampleMaker, rng: random.Random) -> Sample:
    """One sample of the mixture."""
    family = rng.choices(list(MIXTURE), weights=list(MIXTURE.values()))[0]
    if family == "greeting":
        return maker.plain(greeting(rng))
    if family == "story":
        return maker.plain(story(rng))
    if family == "image":
        return maker.image_chat(image_task(rng, words=maker.recipe >= 2))
    if family == "raw_qa":
        task = random_task(rng)
        return maker.plain(f"Q: {task.question}\nA: {task.answer}")
    history = qa_messages(random_task(rng)) if rng.random() < 0.3 else []
    if family == "chat_qa":
        return maker.chat(history + qa_messages(random_task(rng)))
    case = training_tool_case(rng)
    return maker.chat(history + tool_conversation(rng, case), tools=case.tools)


def make_samples(tokenizer_dir: str | Path, config: ModelConfig, seed: int,
                 count: int) -> list[Sample]:
    maker, rng = SampleMaker(tokenizer_dir, config), random.Random(seed)
    return [make_sample(maker, rng) for _ in range(count)]
