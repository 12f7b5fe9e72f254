"""Every route through the official openai client: shapes, usage numbers, sampling options."""

from __future__ import annotations

import base64
import io
import json
import threading
import time

import httpx
import openai
import pytest
from PIL import Image

from tests.server.conftest import MODEL

HI = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def _text(message) -> str:
    """Reasoning and content of a message or delta (random weights may close </think> early)."""
    return (message.model_extra.get("reasoning_content") or "") + "|" + (message.content or "")


def _prompt_len(live, messages, **kwargs) -> int:
    tokenizer = live.engine.tokenizer
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, **kwargs)))


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list().data] == [MODEL, "alias"]
    card = client.models.retrieve("alias")
    assert card.id == "alias" and card.object == "model" and card.owned_by == "glmflash"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


def test_chat_usage_counts_the_rendered_prompt(live, client):
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=4, **GREEDY)
    assert out.object == "chat.completion" and out.model == MODEL and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert out.usage.prompt_tokens == _prompt_len(live, HI) == 19
    assert out.usage.completion_tokens == 4 and out.usage.total_tokens == 23
    assert 0 <= out.usage.completion_tokens_details.reasoning_tokens <= 4
    assert live.hook.prepared[-1].params.max_tokens == 4


def test_default_max_tokens_is_the_rest_of_the_context(live, client):
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=None,
                                   extra_body={"stop_token_ids": list(range(1088))})
    assert live.hook.prepared[-1].params.max_tokens == live.engine.max_seq_len - 19


def test_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=HI, max_completion_tokens=6, **GREEDY)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    first, *middle, finish, usage = chunks
    assert first.choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and usage.choices == []
    assert finish.choices[0].finish_reason == "length" and finish.choices[0].delta.content is None
    reasoning = "".join(c.choices[0].delta.model_extra["reasoning_content"] or "" for c in middle)
    content = "".join(c.choices[0].delta.content or "" for c in middle)
    assert f"{reasoning}|{content}" == _text(whole.choices[0].message)
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (19, 6)
    assert len({c.id for c in chunks}) == 1


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                                 stream=True, **GREEDY))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_n_and_seed(client):
    kwargs = {"model": MODEL, "messages": HI, "max_tokens": 5, "n": 3, "seed": 7,
              "temperature": 1.0}
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [_text(c.message) for c in a.choices]
    assert texts == [_text(c.message) for c in b.choices]
    assert len(set(texts)) > 1
    assert a.usage.completion_tokens <= 15 and a.usage.prompt_tokens == 19


def test_stop_string_ends_the_content(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "SCRIPT:thought</think>one. STOP two"}],
        max_tokens=30, stop=["STOP", "never"])
    (choice,) = out.choices
    assert choice.message.content == "one. " and choice.finish_reason == "stop"


def test_chat_logprobs_shape(client):
    out = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=3, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    entries = out.choices[0].logprobs.content
    assert len(entries) == 3
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.logprob == entry.top_logprobs[0].logprob  # greedy picks the top token
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes).decode() == entry.token
    streamed = [e for c in client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=3, logprobs=True, top_logprobs=2, stream=True,
        **GREEDY) if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_template_options_reach_the_prompt(live, client):
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1,
                                   reasoning_effort="low")
    assert "Reasoning Effort: Low<|user|>" in live.hook.prepared[-1].prompt_text
    history = [{"role": "user", "content": "a"},
               {"role": "assistant", "content": "b", "reasoning_content": "old thought"},
               {"role": "user", "content": "c"}]
    client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                   extra_body={"chat_template_kwargs": {"clear_thinking": True}})
    assert "<|assistant|><think></think>b<|user|>c" in live.hook.prepared[-1].prompt_text


def test_sampling_extensions_are_accepted(live, client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "developer", "content": "be brief"}, *HI], max_tokens=3,
        temperature=0.8, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5,
        logit_bias={"5": 10}, response_format={"type": "json_object"},
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                    "skip_special_tokens": False, "stop_token_ids": [1024]})
    params = live.hook.prepared[-1].params
    assert (params.top_k, params.min_p, params.repetition_penalty) == (20, 0.05, 1.1)
    assert out.choices[0].finish_reason in ("length", "stop")
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})


@pytest.mark.parametrize("prompt,num_prompts", [
    ("Hello", 1), (["Hello", "The sky"], 2), ([5, 6, 7], 1), ([[5, 6], [7, 8, 9]], 2)],
    ids=["string", "strings", "ids", "id_lists"])
def test_completions_prompt_forms(live, client, prompt, num_prompts):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, n=2, **GREEDY)
    assert out.object == "text_completion" and [c.index for c in out.choices] == \
        list(range(2 * num_prompts))
    prompts = live.hook.prepared[-1].prompt_token_ids
    assert out.usage.prompt_tokens == sum(map(len, prompts)) and len(prompts) == num_prompts
    assert out.usage.completion_tokens == 6 * num_prompts


def test_completions_echo_and_logprobs(client):
    echoed = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True,
                                       **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, logprobs=2,
                                      **GREEDY)
    assert echoed.choices[0].text == "Hello" + plain.choices[0].text
    lp = plain.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]


def test_completions_stream(client):
    chunks = list(client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4,
                                            stream=True, stream_options={"include_usage": True},
                                            **GREEDY))
    texts = {0: "", 1: ""}
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    whole = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=4, **GREEDY)
    assert texts == {c.index: c.text for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []
    offsets = [o for c in client.completions.create(model=MODEL, prompt="a", max_tokens=4,
                                                    stream=True, logprobs=1, **GREEDY)
               if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert len(offsets) == 4 and offsets[0] == 0 and offsets == sorted(offsets)


def test_stream_lines_survive_line_separators_in_the_text(live):
    """Generated text holding U+2028, U+2029 or U+0085 (JSON leaves them raw) must not cut a
    `data:` line for a client that splits lines as str.splitlines does (httpx's aiter_lines):
    every line still parses, and the text comes back whole."""
    text = "a\u2028b\u2029c\x85d"
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"SCRIPT:</think>{text}"}],
            "max_tokens": 50, "stream": True}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text


def test_health_and_metrics(live, client):
    assert httpx.get(f"{live.url}/health").json() == {"status": "ok"}
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **GREEDY)
    response = httpx.get(f"{live.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("glmflash_prompt_tokens_total", "glmflash_completion_tokens_total",
                 "glmflash_num_queued_requests", "glmflash_num_running_requests",
                 "glmflash_cache_usage_fraction", "glmflash_time_to_first_token_seconds_bucket",
                 "glmflash_inter_token_latency_seconds_count"):
        assert f"\n{name}" in text, name
    assert 'glmflash_requests_total{route="/v1/chat/completions",status="200"}' in text
    count = next(line for line in text.splitlines()
                 if line.startswith("glmflash_time_to_first_token_seconds_count"))
    assert int(count.split()[1]) >= 1


def test_metrics_gauges_come_from_a_snapshot_taken_on_the_engine_thread(live, client,
                                                                      monkeypatch):
    threads: list[str] = []
    publish = type(live.engine)._publish_stats

    def spy(engine) -> None:
        threads.append(threading.current_thread().name)
        publish(engine)

    monkeypatch.setattr(type(live.engine), "_publish_stats", spy)
    client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2, **GREEDY)
    live.wait_idle()
    # The snapshot of the step that ended the request follows its last delta closely.
    deadline = time.monotonic() + 5
    while "\nglmflash_num_running_requests 0\n" not in httpx.get(f"{live.url}/metrics").text:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert "\nglmflash_cache_usage_fraction 0\n" in httpx.get(f"{live.url}/metrics").text
    assert threads and set(threads) == {"glmflash-engine"}


def test_image_input(live, client):
    buffer = io.BytesIO()
    Image.new("RGB", (56, 84), (200, 30, 60)).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    content = [{"type": "text", "text": "Describe."}, {"type": "image_url", "image_url": {
        "url": url, "detail": "auto"}}]
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                 "content": content}],
                                         max_tokens=3, **GREEDY)
    prepared = live.hook.prepared[-1]
    image_id = live.engine.tokenizer.token_to_id("<|image|>")
    num_image_tokens = prepared.prompt_token_ids[0].count(image_id)
    assert num_image_tokens > 1 and prepared.media is not None
    assert out.usage.prompt_tokens == len(prepared.prompt_token_ids[0])
    assert out.usage.completion_tokens == 3
