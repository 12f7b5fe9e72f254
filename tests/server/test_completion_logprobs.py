"""/v1/completions `echo` + `logprobs` (prompt log-probabilities, as evaluation harnesses use
them) and how streamed log-probabilities travel with their text."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import PackedRunner, load_tiny
from tests.server.conftest import MODEL

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
# fp32 on the tiny model, one whole prefill against one whole forward (measured: <= 3e-6; 0 with
# the prompt alone in the engine). Two prompts of one request may be prefilled in one packed
# forward, whose matrix row counts change fp32 rounding (measured up to 1.1e-5 against each
# prompt alone), so the test sends each prompt alone to an idle engine.
LOGPROB_ATOL = 1e-5
MULTIBYTE = "héllo 中文 ✓ 🙂 ok"


@pytest.fixture(scope="module")
def teacher_forced(tiny_dirs):
    model = load_tiny(tiny_dirs["embedded"])

    def log_softmax(prompt: list[int]) -> torch.Tensor:
        return torch.log_softmax(PackedRunner(model, 1).forward({0: prompt}).float(), dim=-1)
    return log_softmax


def test_echo_logprobs_equal_teacher_forced_log_softmax(live, client, teacher_forced):
    tokenizer = live.engine.tokenizer
    for prompt in (tokenizer.encode("The capital of France is Paris"), [5, 6, 7, 8, 9, 10]):
        live.wait_idle()
        choice = client.completions.create(model=MODEL, prompt=[prompt], max_tokens=1,
                                           logprobs=2, echo=True, **GREEDY).choices[0]
        lp = choice.logprobs
        assert len(lp.tokens) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert "".join(lp.tokens) == choice.text
        assert choice.text.startswith(tokenizer.decode(prompt))
        expected = teacher_forced(prompt)
        for p in range(len(prompt) - 1):
            target = prompt[p + 1]
            assert lp.token_logprobs[p + 1] == pytest.approx(expected[p, target].item(),
                                                             abs=LOGPROB_ATOL)
            top = expected[p].topk(2)
            for token_id, value in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                text = live.app_state.token_text.text(token_id)
                assert lp.top_logprobs[p + 1][text] == pytest.approx(value, abs=LOGPROB_ATOL)
        # The generated token: greedy, so the most likely one, named in top_logprobs.
        assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))


def test_echo_logprobs_as_lm_eval_reads_them(client):
    """lm-eval's local-completions scores continuation tokens [ctxlen:-1] and calls a choice
    greedy when each is the most likely in its top_logprobs."""
    context, continuation = [11, 12, 13, 14], [15, 16, 17]
    out = client.completions.create(model=MODEL, prompt=[context + continuation], max_tokens=1,
                                    logprobs=1, echo=True, temperature=0, seed=1234)
    lp = out.choices[0].logprobs
    scored = lp.token_logprobs[len(context):-1]
    assert len(scored) == len(continuation) and all(v < 0 for v in scored)
    assert all(max(top.values()) >= value
               for value, top in zip(scored, lp.top_logprobs[len(context):-1], strict=True))


def test_streamed_echo_logprobs_equal_the_whole_response(client):
    kwargs = dict(model=MODEL, prompt=MULTIBYTE, max_tokens=4, logprobs=1, echo=True, **GREEDY)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    text = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs
              for v in c.choices[0].logprobs.token_logprobs]
    assert text == whole.text and text.startswith(MULTIBYTE)
    assert tokens == whole.logprobs.tokens and "".join(tokens) == text
    assert values == whole.logprobs.token_logprobs


def test_logprobs_zero_names_the_sampled_token(client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=0,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    assert [len(top) for top in lp.top_logprobs] == [1, 1, 1]
    for value, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert list(top.values()) == [value]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_logprobs_ride_with_their_text(client, endpoint):
    """A scripted multi-byte output: every chunk before the last has text, and the streamed
    logprob tokens join to the streamed text."""
    script = f"SCRIPT:{MULTIBYTE}"
    if endpoint == "completions":
        stream = client.completions.create(model=MODEL, prompt=script, max_tokens=40,
                                           logprobs=1, stream=True, temperature=0)
        chunks = [(c.choices[0].text, c.choices[0].logprobs and c.choices[0].logprobs.tokens,
                   c.choices[0].finish_reason) for c in stream]
    else:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": script}], max_tokens=40,
            logprobs=True, stream=True, temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        chunks = [(_chat_text(c.choices[0].delta),
                   c.choices[0].logprobs and [t.token for t in c.choices[0].logprobs.content],
                   c.choices[0].finish_reason) for c in stream][1:]
    texts = [text for text, _, _ in chunks]
    tokens = [t for _, part, _ in chunks for t in part or []]
    assert "".join(texts) == MULTIBYTE == "".join(tokens)
    assert chunks[-1][2] == "stop" and all(texts[:-1])


def _chat_text(delta) -> str:
    return (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
