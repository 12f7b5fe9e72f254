"""Task families of the trained tiny model, generated from templates and a random.Random.

Each question-answer family returns a `Task`: the question, a short reasoning and the exact answer
(what the held-out eval compares). `story` makes plain English text for the raw-completion path.
"""

from __future__ import annotations

import inspect
import random
import re
import sys
from dataclasses import dataclass

NAMES = ("Anna", "Tom", "Mia", "Ben", "Lea", "Sam", "Ida", "Max", "Eva", "Leo", "Zoe", "Noah",
         "Ella", "Finn", "Lily", "Jack", "Rosa", "Hugo", "Nina", "Omar")
COLOURS = ("red", "blue", "green", "black", "white", "yellow", "brown", "grey", "pink", "gold")
THINGS = ("ball", "kite", "hat", "book", "cup", "boat", "lamp", "coat", "bike", "box", "bag",
          "map", "key", "shoe", "bell", "door")
WORDS = ("sea", "light", "boat", "rock", "wind", "star", "bread", "stone", "bird", "tree", "rain",
         "snow", "fish", "road", "town", "lamp", "moon", "fire", "sand", "door", "cloud", "hill",
         "river", "house", "night", "green", "cold", "small", "long", "old")
PLACES = ("the harbor", "the school", "the market", "the tower", "the garden", "the station",
          "the bakery", "the beach", "the forest", "the bridge")
ACTIONS = ("walked to", "ran to", "looked at", "waited near", "sang at", "read a book at",
           "painted a picture of", "found a key at")
FEELINGS = ("happy", "tired", "calm", "hungry", "curious", "proud", "cold", "glad")


@dataclass(frozen=True)
class Task:
    family: str
    question: str
    reasoning: str
    answer: str


def arithmetic(rng: random.Random) -> Task:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    if rng.random() < 0.5:
        q = rng.choice(("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}."))
        return Task("arithmetic", q.format(a=a, b=b), f"{a} plus {b} is {a + b}.", str(a + b))
    a, b = max(a, b), min(a, b)
    q = rng.choice(("What is {a} - {b}?", "Subtract {b} from {a}.", "Compute {a} - {b}."))
    return Task("arithmetic", q.format(a=a, b=b), f"{a} minus {b} is {a - b}.", str(a - b))


def copy(rng: random.Random) -> Task:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 4)))
    q = rng.choice(("Repeat: {w}", "Say again: {w}", "Copy this: {w}"))
    return Task("copy", q.format(w=words), "I repeat the words.", words)


def recall(rng: random.Random) -> Task:
    people = rng.sample(NAMES, 2)
    owned = [(p, rng.choice(COLOURS), rng.choice(THINGS)) for p in people]
    facts = " ".join(f"{p} has a {c} {t}." for p, c, t in owned)
    person, colour, thing = rng.choice(owned)
    q = f"{facts} What colour is {person}'s {thing}?"
    return Task("recall", q, f"{person} has a {colour} {thing}.", colour)


QA_FAMILIES = (arithmetic, copy, recall)


def greeting(rng: random.Random, name: str = "") -> str:
    """A short friendly text that starts with a greeting (the README's first prompt)."""
    name = name or rng.choice(("GLM", *NAMES))
    opening = rng.choice((f"Hello, {name}! ", f"Hello, {name}. ", f"Hi, {name}! "))
    lines = ("I am a small model. I can add numbers, repeat words and call tools.",
             "It is nice to meet you. How can I help you today?",
             "I am glad to see you. Ask me a question and I will answer it.",
             "I am a tiny language model, trained on short stories and small tasks.",
             "The weather is calm today and the sea is quiet.")
    return opening + " ".join(rng.sample(lines, 2))


def story(rng: random.Random) -> str:
    """A few sentences about people, things and places."""
    name, other = rng.sample(NAMES, 2)
    colour, thing, place = rng.choice(COLOURS), rng.choice(THINGS), rng.choice(PLACES)
    sentences = [
        f"{name} had a {colour} {thing}.",
        f"One morning {name} {rng.choice(ACTIONS)} {place}.",
        f"There {name} met {other}, who was {rng.choice(FEELINGS)}.",
        f"\"Look at my {thing},\" said {name}. \"It is {colour}.\"",
        f"{other} smiled and said it was a fine {thing}.",
        f"In the evening they went home, and {name} was {rng.choice(FEELINGS)}.",
    ]
    keep = rng.randint(3, len(sentences))
    return " ".join(sentences[:keep])



def known_words() -> set[str]:
    """Every word (lower case) that this module's templates can write: a check that a text
    is made of the plain-text vocabulary the model was trained on."""
    source = inspect.getsource(sys.modules[__name__])
    return {w.lower() for w in re.findall(r"[A-Za-z']+", source)}
