"""A small agent written for the Responses API: it runs the tools the model calls and feeds
their results back (chained with `previous_response_id`) until the model answers.

    python examples/agent_loop.py --base-url http://localhost:30000/v1 "What is 17 * 23?"
"""

from __future__ import annotations

import ast
import json
import operator

import openai
from _common import first_model, parse_args

TOOLS = [{"type": "function", "name": "calculate",
          "description": "Evaluate an arithmetic expression with + - * / and parentheses",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}]
MAX_STEPS = 5


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
              ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """+ - * / and parentheses over numbers; anything else is an error message for the model."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only + - * / and parentheses are allowed")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"


def run_agent(client: openai.OpenAI, model: str, task: str) -> tuple[str, list[dict]]:
    """The final answer and the tool calls made on the way."""
    calls_made: list[dict] = []
    response = client.responses.create(model=model, input=task, tools=TOOLS,
                                       max_output_tokens=512)
    for _ in range(MAX_STEPS):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text, calls_made
        results = []
        for call in calls:
            output = calculate(**json.loads(call.arguments))
            print(f"{call.name}({call.arguments}) -> {output}")
            calls_made.append({"name": call.name, "arguments": call.arguments, "output": output})
            results.append({"type": "function_call_output", "call_id": call.call_id,
                            "output": output})
        response = client.responses.create(model=model, input=results, tools=TOOLS,
                                           previous_response_id=response.id,
                                           max_output_tokens=512)
    return response.output_text, calls_made


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv, extra=lambda p: p.add_argument(
        "task", nargs="?", default="What is 17 * 23? Use the calculator."))
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    answer, calls = run_agent(client, args.model or first_model(client), args.task)
    print("answer:", answer)
    return {"answer": answer, "calls": calls}


if __name__ == "__main__":
    main()
