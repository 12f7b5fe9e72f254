"""Function calling through the openai SDK's chat API: the model asks for a tool, we run it and
send the result back for the final answer.

    python examples/openai_tools.py --base-url http://localhost:30000/v1
"""

from __future__ import annotations

import json

import openai
from _common import first_model, parse_args

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def get_weather(city: str) -> str:
    return json.dumps({"city": city, "forecast": "sunny", "celsius": 21})


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or first_model(client)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           max_tokens=256)
    message = reply.choices[0].message
    if not message.tool_calls:
        print("no tool call; the model answered:", message.content)
        return {"tool_calls": [], "answer": message.content}
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        result = get_weather(**json.loads(call.function.arguments))
        print(f"{call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                           max_tokens=256)
    print("answer:", final.choices[0].message.content)
    return {"tool_calls": message.tool_calls, "answer": final.choices[0].message.content}


if __name__ == "__main__":
    main()
