"""Chat with glmflash through the official openai SDK: one answer, then the same streamed.

    python examples/openai_chat.py --base-url http://localhost:30000/v1

GLM-5.3-Flash thinks first: the reasoning arrives in `reasoning_content` (a field the SDK keeps
in `model_extra`), the answer in `content`.
"""

from __future__ import annotations

import openai
from _common import first_model, parse_args


def main(argv: list[str] | None = None) -> dict[str, str]:
    args = parse_args(__doc__.splitlines()[0], argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or first_model(client)
    messages = [{"role": "user", "content": "Name three primary colours."}]

    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=64)
    message = reply.choices[0].message
    print("reasoning:", message.model_extra.get("reasoning_content"))
    print("answer:", message.content)

    streamed = ""
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=64,
                                                stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            delta = chunk.choices[0].delta
            piece = delta.content or delta.model_extra.get("reasoning_content") or ""
            streamed += piece
            print(piece, end="", flush=True)
        elif chunk.usage is not None:
            print(f"\n[{chunk.usage.completion_tokens} tokens]")
    return {"answer": message.content or "", "streamed": streamed,
            "finish_reason": reply.choices[0].finish_reason}


if __name__ == "__main__":
    main()
