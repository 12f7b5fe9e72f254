"""glmflash through LiteLLM, as an OpenAI-compatible provider (`openai/<served name>`).

    pip install 'glmflash[examples]'
    python examples/litellm_chat.py --base-url http://localhost:30000/v1
"""

from __future__ import annotations

import os

import openai
from _common import first_model, parse_args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    # LiteLLM fetches its model price list at import unless told to use its bundled copy.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    model = args.model or first_model(openai.OpenAI(base_url=args.base_url,
                                                    api_key=args.api_key))
    reply = litellm.completion(model=f"openai/{model}", api_base=args.base_url,
                               api_key=args.api_key, max_tokens=64,
                               messages=[{"role": "user", "content": "Say hello."}])
    message = reply.choices[0].message
    print("reasoning:", getattr(message, "reasoning_content", None))
    print("answer:", message.content)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in litellm.completion(
        model=f"openai/{model}", api_base=args.base_url, api_key=args.api_key, max_tokens=16,
        messages=[{"role": "user", "content": "Count to three."}], stream=True))
    print("streamed:", streamed)
    return {"reply": reply, "streamed": streamed}


if __name__ == "__main__":
    main()
