"""Our network vs transformers' glm5_next on the same (dequantised FP8) weights, fp32, CPU."""

from __future__ import annotations

import pytest
import torch

from glmflash.model.forward_batch import token_slots_of
from tests.conftest import LOGIT_ATOL, PackedRunner, load_tiny
from tests.oracle import oracle_logits

VARIANTS = ["embedded", "kpool16", "recipe"]
LENGTHS = [70, 33, 5]
# Relative to the layer's largest value; measured worst case 5e-6 (tests/model/README.md).
LAYER_RTOL = 2e-5


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models(tiny_dirs):
    return {v: load_tiny(tiny_dirs[v]) for v in VARIANTS}


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_batch_logits_match_oracle(variant, models, oracles):
    """Three sequences of different lengths in one packed forward == each alone in the oracle."""
    model = models[variant]
    prompts = _prompts(1000, LENGTHS)
    runner = PackedRunner(model, num_seqs=len(prompts))
    logits = runner.forward(dict(enumerate(prompts)))
    offset = 0
    for prompt in prompts:
        ours = logits[offset: offset + len(prompt)]
        ref = oracle_logits(oracles[variant], prompt)
        offset += len(prompt)
        assert (ours - ref).abs().max().item() < LOGIT_ATOL
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_layer_matches_oracle(variant, models, oracles):
    """Residual streams after every decoder layer, so a failure names the layer."""
    model, oracle = models[variant], oracles[variant]
    prompt = _prompts(1000, [64], seed=3)[0]
    ours: list[torch.Tensor] = []
    PackedRunner(model, 1).forward({0: prompt}, layer_outputs=ours)
    with torch.no_grad():
        out = oracle(input_ids=torch.tensor([prompt]), use_cache=False, output_hidden_states=True)
    # The oracle records the input streams, the outputs of layers 0..N-2, then the final norm.
    num_layers = model.config.num_hidden_layers
    theirs = [h[0] for h in out.hidden_states[1:num_layers]]
    theirs.append(out.hidden_states[num_layers][0])
    ours[-1] = model.text.norm(ours[-1].mean(dim=1))
    for layer, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        scale = b.abs().max().item()
        err = (a - b).abs().max().item()
        assert err < LAYER_RTOL * max(1.0, scale), f"layer {layer}: max |diff| {err:.2e}"


@pytest.mark.parametrize("variant", ["embedded", "kpool16"])
def test_indexer_selection_matches_oracle(variant, models, oracles):
    """Selected key positions per query and full layer equal the oracle's (sets), and are sparse."""
    model, oracle = models[variant], oracles[variant]
    prompt = _prompts(1000, [90], seed=5)[0]
    ours, theirs = _capture_ours(model, prompt), _capture_oracle(oracle, prompt)
    assert sorted(ours) == sorted(theirs)
    strictly_sparse = 0
    for layer in ours:
        for t, (a, b) in enumerate(zip(ours[layer], theirs[layer], strict=True)):
            assert a == b, f"layer {layer} query {t}: {sorted(a ^ b)} differ"
            strictly_sparse += len(a) < t + 1
    assert strictly_sparse > 0, "top-k never selected a strict subset: the test is too short"


def _capture_ours(model, prompt) -> dict[int, list[set[int]]]:
    captured: dict[int, list[set[int]]] = {}
    hooks = []
    for i, layer in enumerate(model.text.layers):
        if not layer.is_kda and layer.self_attn.indexer is not None:
            def hook(_m, _a, out, i=i):
                captured[i] = [{position[s] for s in r[r >= 0].tolist()} for r in out[1]]
            hooks.append(layer.self_attn.register_forward_hook(hook))
    runner = PackedRunner(model, 1)
    # The runner scatters the sequence over pages: map cache slots back to positions.
    slots = token_slots_of(runner.pages[0].tolist(), 0, len(prompt), runner.PAGE_SIZE)
    position = {int(s): p for p, s in enumerate(slots)}
    runner.forward({0: prompt})
    for h in hooks:
        h.remove()
    return captured


def _capture_oracle(oracle, prompt) -> dict[int, list[set[int]]]:
    captured: dict[int, list[set[int]]] = {}
    hooks = []
    for i, layer in enumerate(oracle.model.language_model.layers):
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            def hook(_m, _a, out, i=i):
                captured[i] = [set(r[r >= 0].tolist()) for r in out[0]]
            hooks.append(indexer.register_forward_hook(hook))
    with torch.no_grad():
        oracle(input_ids=torch.tensor([prompt]), use_cache=False)
    for h in hooks:
        h.remove()
    return captured


def test_oracle_uses_torch_paths_when_a_kernel_package_was_bound(monkeypatch):
    """A package imported before the oracle (fla, on the GPU machine) binds the modeling file's
    KDA and conv functions to its kernels; loading the oracle points them back at torch code."""
    import functools
    import inspect

    from transformers.models.glm5_next import modeling_glm5_next as modeling

    from tests import oracle

    torch_paths = {name: inspect.unwrap(getattr(modeling, name)) for name in oracle._PACKAGE_BOUND}
    for name, torch_fn in torch_paths.items():
        @functools.wraps(torch_fn)
        def package_kernel(*args, **kwargs):
            raise AssertionError("the package kernel ran")
        monkeypatch.setattr(modeling, name, package_kernel)
    oracle._use_torch_paths()
    for name, torch_fn in torch_paths.items():
        assert getattr(modeling, name) is torch_fn
