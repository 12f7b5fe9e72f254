"""Images and video through Engine.chat: same tokens as the reference, request boundaries."""

from __future__ import annotations

import base64
import io

import pytest
import torch

from glmflash import Engine, SamplingParams
from tests.multimodal.conftest import make_video, oracle_media_kwargs, random_image
from tests.oracle import NEAR_TIE

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def engine(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    return Engine(tiny_dirs["embedded"], device="cpu", dtype="float32", context_length=2048,
                  background_loop=False, media_local_root=str(root)), root


def _assert_oracle_greedy(oracle, mm, produced: list[int]) -> None:
    kwargs = oracle_media_kwargs(mm)
    ids = torch.tensor([mm.token_ids + produced])
    with torch.no_grad():
        logits = oracle(input_ids=ids, use_cache=False, **kwargs).logits[0]
    for i, token in enumerate(produced):
        top2 = logits[len(mm.token_ids) - 1 + i].topk(2)
        near_tie = float(top2.values[0] - top2.values[1]) < NEAR_TIE
        assert token == int(top2.indices[0]) or (near_tie and token == int(top2.indices[1]))


def _chat_and_check(engine, oracle, content: list[dict]) -> None:
    messages = [{"role": "user", "content": content}]
    out = engine.chat(messages, sampling_params=GREEDY)
    prompt = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    mm = engine.prepare_multimodal(engine.tokenizer.encode(prompt), messages)
    assert out.result.prompt_token_ids == mm.token_ids
    _assert_oracle_greedy(oracle, mm, out.result.token_ids)


def test_chat_with_two_images_matches_reference(engine, oracles):
    eng, _ = engine
    content = [{"type": "image_url", "image_url": {"url": _data_url(random_image(1, 70, 90))}},
               {"type": "text", "text": "and"},
               {"type": "image_url", "image_url": {"url": _data_url(random_image(2, 40, 50))}},
               {"type": "text", "text": "Which is brighter?"}]
    _chat_and_check(eng, oracles["embedded"], content)


def test_chat_with_a_video_matches_reference(engine, oracles):
    eng, root = engine
    path = make_video(root / "clip.mp4", num_frames=12, fps=6, height=56, width=56)
    content = [{"type": "video_url", "video_url": {"url": str(path)}},
               {"type": "text", "text": "What moves?"}]
    _chat_and_check(eng, oracles["embedded"], content)


@pytest.mark.parametrize("content,message", [
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 9,
     "at most 8 images"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
      {"type": "video_url", "video_url": {"url": "x.mp4"}}], "not both"),
    ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
     "cannot decode"),
    ([{"type": "image_url", "image_url": {}}], "needs a url"),
])
def test_request_boundaries_raise_value_errors(engine, content, message):
    eng, _ = engine
    with pytest.raises(ValueError, match=message):
        eng.chat([{"role": "user", "content": content}], sampling_params=GREEDY)
    # The engine is unharmed: a text request still works and the cache is whole.
    assert eng.generate("still fine", GREEDY)[0].finish_reason == "length"
    assert eng.cache.num_free_pages == eng.cache.plan.num_pages
