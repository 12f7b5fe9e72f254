"""Generated tool schemas (random names, parameters and types) and the conversations that use
them: the user asks, the assistant thinks and calls the matching tool (glm47 format through the
chat template), the tool answers, the assistant gives the final answer."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

SYLLABLES = ("ka", "lo", "mi", "ru", "ta", "ne", "po", "si", "vu", "ze", "da", "fi", "go", "ha",
             "ju", "be", "co", "xe", "ny", "wa")
VERBS = ("get", "find", "check", "fetch", "look", "read")
NOUNS = ("weather", "price", "score", "size", "speed", "height", "colour", "time", "name",
         "level", "count", "age", "distance", "rating", "status", "owner")
TYPES = ("string", "integer", "number", "boolean")
VALUE_WORDS = ("Paris", "Rome", "Oslo", "Lima", "Tokyo", "river", "stone", "garden", "tower",
               "market", "blue", "north", "apple", "light", "winter", "harbor")


@dataclass(frozen=True)
class ToolCase:
    """One tool-use request: the tools offered, the user's words and the right call."""

    tools: list[dict[str, Any]]
    user: str
    name: str
    arguments: dict[str, Any]
    noun: str


def random_word(rng: random.Random, syllables: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(syllables))


def random_tool(rng: random.Random, noun: str) -> dict[str, Any]:
    name = f"{rng.choice(VERBS)}_{random_word(rng, rng.randint(2, 3))}"
    params = {}
    for _ in range(rng.randint(1, 2)):
        params[random_word(rng, 2)] = {"type": rng.choice(TYPES)}
    return {"type": "function", "function": {
        "name": name, "description": f"Get the {noun}.",
        "parameters": {"type": "object", "properties": params, "required": list(params)}}}


def random_value(rng: random.Random, kind: str) -> Any:
    if kind == "integer":
        return rng.randint(1, 99)
    if kind == "number":
        return rng.randint(1, 99) + rng.choice((0.5, 0.25, 0.75))
    if kind == "boolean":
        return rng.random() < 0.5
    return rng.choice(VALUE_WORDS)


def spoken(value: Any) -> str:
    """How the user writes a value (booleans as JSON, as the call will carry them)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def tool_case(rng: random.Random) -> ToolCase:
    nouns = rng.sample(NOUNS, rng.choice((1, 2, 2)))
    tools = [random_tool(rng, n) for n in nouns]
    pick = rng.randrange(len(tools))
    fn = tools[pick]["function"]
    arguments = {p: random_value(rng, s["type"]) for p, s in fn["parameters"]["properties"].items()}
    parts = " and ".join(f"{p} {spoken(v)}" for p, v in arguments.items())
    user = rng.choice(("What is the {n} for {a}?", "Please get the {n} with {a}.",
                       "I need the {n} for {a}.")).format(n=nouns[pick], a=parts)
    return ToolCase(tools, user, fn["name"], arguments, nouns[pick])


def tool_result(rng: random.Random) -> str:
    return str(rng.randint(1, 999))


def tool_conversation(rng: random.Random, case: ToolCase) -> list[dict[str, Any]]:
    """user -> assistant (thinks, calls) -> tool -> assistant (thinks, answers)."""
    result = tool_result(rng)
    call = {"id": "call_0", "type": "function",
            "function": {"name": case.name, "arguments": case.arguments}}
    return [
        {"role": "user", "content": case.user},
        {"role": "assistant", "content": "", "tool_calls": [call],
         "reasoning_content": f"The user wants the {case.noun}. I call {case.name}."},
        {"role": "tool", "tool_call_id": "call_0", "content": result},
        {"role": "assistant", "content": f"The {case.noun} is {result}.",
         "reasoning_content": f"The tool says {result}."},
    ]
