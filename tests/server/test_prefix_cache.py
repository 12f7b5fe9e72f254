"""A multi-turn conversation through the server reuses its prefix: cached_tokens in the usage
of the next turn, /metrics counting the hits, and the same text as a server without the cache."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL, start_server

GREEDY = dict(temperature=0, max_tokens=5, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def servers(tiny_dirs):
    on = start_server(tiny_dirs["embedded"], skip_kernel_warmup=True)
    off = start_server(tiny_dirs["embedded"], skip_kernel_warmup=True, disable_radix_cache=True)
    yield on, off
    on.stop()
    off.stop()


def _turns(server, stream: bool) -> list[tuple[str, int, int]]:
    """(content, prompt tokens, cached tokens) of each of three turns."""
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about cats."}]
    out = []
    for question in ("And dogs?", "And birds?", None):
        if stream:
            chunks = list(client.chat.completions.create(
                model=MODEL, messages=messages, stream=True,
                stream_options={"include_usage": True}, **GREEDY))
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            usage = chunks[-1].usage
        else:
            reply = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
            content, usage = reply.choices[0].message.content or "", reply.usage
        out.append((content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        if question:
            messages += [{"role": "assistant", "content": content},
                         {"role": "user", "content": question}]
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_conversation_reuses_its_prefix_with_the_same_output(servers, stream):
    on, off = servers
    with_cache, without = _turns(on, stream), _turns(off, stream)
    assert [t[:2] for t in with_cache] == [t[:2] for t in without]
    assert all(cached == 0 for *_, cached in without)
    # Each turn's prompt starts with the whole previous prompt (the chat template's history).
    previous_prompts = [0] + [prompt for _, prompt, _ in with_cache[:-1]]
    for (_, _, cached), previous in zip(with_cache, previous_prompts, strict=True):
        assert cached == previous


def test_metrics_report_hits_pages_and_snapshots(servers):
    on, _ = servers
    _turns(on, stream=False)
    text = httpx.get(f"{on.url}/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("glmflash_prefix_cache")}
    assert values["glmflash_prefix_cache_hit_tokens_total"] > 0
    assert 0 < values["glmflash_prefix_cache_hit_rate"] < 1
    assert values["glmflash_prefix_cache_pages"] > 0
    assert 0 < values["glmflash_prefix_cache_snapshots"] <= \
        values["glmflash_prefix_cache_max_snapshots"]
    assert "# TYPE glmflash_prefix_cache_hit_tokens_total counter" in text
