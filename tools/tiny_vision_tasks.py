"""Generated pictures (pillow) with a question and its answer: a shape of one colour on a
background of another (no writing yet: issue 16 also asks for a few words of text)."""

from __future__ import annotations

import base64
import io
import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

PALETTE = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 170, 60),
           "black": (10, 10, 10), "white": (245, 245, 245), "yellow": (240, 220, 40)}
SHAPES = ("square", "circle", "triangle")
SIZE = 112


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


def image_task(rng: random.Random) -> ImageTask:
    background, colour = rng.sample(list(PALETTE), 2)
    shape = rng.choice(SHAPES)
    image = draw(background, shape, colour, rng)
    seen = f"I see a {colour} {shape} on {background}."
    kind = rng.randrange(3)
    if kind == 0:
        return ImageTask(image, "What shape is in the picture?", seen, shape)
    if kind == 1:
        return ImageTask(image, f"What colour is the {shape}?", seen, colour)
    return ImageTask(image, "What colour is the background?", seen, background)


def data_url(image: Image.Image) -> str:
    """The picture as a PNG data URL (lossless: the engine sees the training pixels)."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
