"""Generated pictures (pillow) with a question and its answer: a shape of one colour on a
background of another, or (data recipe 2 on) a word written on the background."""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

PALETTE = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60),
           "black": (10, 10, 10), "white": (245, 245, 245), "yellow": (240, 220, 40)}
SHAPES = ("square", "circle", "triangle")
SIZE = 112
WORDS = ("cat", "dog", "sun", "sky", "tree", "boat", "milk", "star", "fish", "rain", "home",
         "book")
# The share of the pictures that show a word, when words are drawn at all.
WORD_SHARE = 0.25
FONT_SIZE = 30


@dataclass(frozen=True)
class ImageTask:
    image: Image.Image
    question: str
    reasoning: str
    answer: str


def draw(background: str, shape: str, colour: str, rng: random.Random) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), PALETTE[background])
    pen = ImageDraw.Draw(image)
    size = rng.randint(40, 70)
    x, y = rng.randint(4, SIZE - size - 4), rng.randint(4, SIZE - size - 4)
    box = (x, y, x + size, y + size)
    if shape == "square":
        pen.rectangle(box, fill=PALETTE[colour])
    elif shape == "circle":
        pen.ellipse(box, fill=PALETTE[colour])
    else:
        pen.polygon([(x + size // 2, y), (x, y + size), (x + size, y + size)],
                    fill=PALETTE[colour])
    return image


def image_task(rng: random.Random, words: bool = False) -> ImageTask:
    """A picture and a question on it; `words`: a share of them show a word instead of a shape
    (without, the stream of `rng` draws is that of data recipe 1)."""
    background, colour = rng.sample(list(PALETTE), 2)
    if words and rng.random() < WORD_SHARE:
        return word_task(background, colour, rng)
    shape = rng.choice(SHAPES)
    image = draw(background, shape, colour, rng)
    seen = f"I see a {colour} {shape} on {background}."
    kind = rng.randrange(3)
    if kind == 0:
        return ImageTask(image, "What shape is in the picture?", seen, shape)
    if kind == 1:
        return ImageTask(image, f"What colour is the {shape}?", seen, colour)
    return ImageTask(image, "What colour is the background?", seen, background)


def word_task(background: str, colour: str, rng: random.Random) -> ImageTask:
    """A word of `WORDS` written in `colour` at a random place on `background`."""
    word = rng.choice(WORDS)
    image = Image.new("RGB", (SIZE, SIZE), PALETTE[background])
    pen = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=FONT_SIZE)
    left, top, right, bottom = pen.textbbox((0, 0), word, font=font)
    x = rng.randint(2, SIZE - (right - left) - 2) - left
    y = rng.randint(2, SIZE - (bottom - top) - 2) - top
    pen.text((x, y), word, fill=PALETTE[colour], font=font)
    return ImageTask(image, "What word is written in the picture?",
                     f"I see the word {word} written in {colour}.", word)


def data_url(image: Image.Image) -> str:
    """The picture as a PNG data URL (lossless: the engine sees the training pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
