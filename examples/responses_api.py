"""The OpenAI Responses API against glmflash: one response, a streamed one, and a follow-up
turn chained with `previous_response_id`.

    python examples/responses_api.py --base-url http://localhost:30000/v1
"""

from __future__ import annotations

import openai
from _common import first_model, parse_args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(__doc__.splitlines()[0], argv)
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or first_model(client)

    first = client.responses.create(model=model, instructions="Answer in one sentence.",
                                    input="Why is the sky blue?", max_output_tokens=128,
                                    reasoning={"effort": "low"})
    for item in first.output:
        if item.type == "reasoning":
            print("reasoning:", "".join(part.text for part in item.content or []))
    print("answer:", first.output_text)

    with client.responses.stream(model=model, input="And at sunset?", max_output_tokens=128,
                                 previous_response_id=first.id) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                print(event.delta, end="", flush=True)
            # A response cut by max_output_tokens ends with response.incomplete (and the SDK's
            # get_final_response() then raises), so keep whichever final event comes.
            elif event.type in ("response.completed", "response.incomplete"):
                second = event.response
    print(f"\n[{second.status}, {second.usage.output_tokens} tokens]")
    return {"first": first, "second": second}


if __name__ == "__main__":
    main()
