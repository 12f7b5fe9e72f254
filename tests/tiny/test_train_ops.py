"""The batched training forms of tools/tiny_train_ops.py against the references they replace:
outputs, states and gradients on varlen batches of fresh sequences."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import glmflash.kernels.kda.ref as kda_ref_module
import glmflash.model.indexer as indexer_module
from glmflash.config import ModelConfig
from glmflash.kernels.fused_moe.ref import fused_moe_ref
from glmflash.kernels.indexer import indexer_select
from glmflash.kernels.indexer.ref import (
    indexer_select_ref,
    indexer_write_ref,
    select_plan,
    write_plan,
)
from glmflash.kernels.kda.ref import causal_conv1d_ref, kda_ref
from glmflash.model.forward_batch import contiguous_page_table
from glmflash.model.state import ModelState
from glmflash.tiny.configs import tiny_config
from tools.tiny_batches import pack_samples
from tools.tiny_data import make_samples
from tools.tiny_indexer_loss import MlaInputs, _layer_loss, indexer_loss
from tools.tiny_train_ops import (
    Padded,
    conv_fresh,
    decayed_products_elementwise,
    dense_experts,
    kda_fresh,
    select_fresh,
    training_ops,
)
from tools.tiny_trainer import PAGE_SIZE, build_models, forward_losses, packed_batch

LENS = [1, 5, 64, 65, 130, 7]
CONFIG = ModelConfig.from_dict(tiny_config("trained"))


def _cu(lens: list[int]) -> list[int]:
    return np.cumsum([0, *lens]).tolist()


def _grads(fn, inputs: list[torch.Tensor], probe: torch.Tensor) -> list[torch.Tensor]:
    for x in inputs:
        x.grad = None
    (fn() * probe).sum().backward()
    return [x.grad.clone() for x in inputs]


def test_kda_fresh_matches_the_reference():
    torch.manual_seed(42)
    total, heads, dim = sum(LENS), 2, 8
    q, k, v = (torch.randn(total, heads, dim, requires_grad=True) for _ in range(3))
    g = (-torch.rand(total, heads, dim) * 0.5).requires_grad_()
    beta = torch.rand(total, heads, requires_grad=True)
    slots = [3, 0, 5, 1, 2, 4]
    states = [torch.randn(6, heads, dim, dim) for _ in range(2)]
    args = dict(cu_seqlens=_cu(LENS), state_slots=slots, is_fresh=[True] * len(LENS))
    ref = lambda: kda_ref(q, k, v, g, beta, states[0], **args)  # noqa: E731
    fresh = lambda: kda_fresh(q, k, v, g, beta, states[1], **args)  # noqa: E731
    torch.testing.assert_close(fresh(), ref(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[1], states[0], rtol=1e-5, atol=1e-5)
    probe = torch.randn(total, heads, dim)
    for got, want in zip(_grads(fresh, [q, k, v, g, beta], probe),
                         _grads(ref, [q, k, v, g, beta], probe), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_elementwise_decayed_products_match_the_einsums():
    """The training form of KDA's decayed key products (outputs and gradients)."""
    torch.manual_seed(7)
    q, k = (torch.randn(3, 16, 8, requires_grad=True) for _ in range(2))
    cum = (-torch.rand(3, 16, 8) * 5).cumsum(1)
    decay = (cum.unsqueeze(2) - cum.unsqueeze(1)).masked_fill(
        ~torch.ones(16, 16, dtype=torch.bool).tril()[None, :, :, None], float("-inf")).exp()
    decay.requires_grad_()
    probe = torch.randn(2, 3, 16, 16)
    results = [_grads(lambda f=f: torch.stack(f(q, k, decay)), [q, k, decay], probe)
               for f in (decayed_products_elementwise, kda_ref_module._decayed_products)]
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.stack(decayed_products_elementwise(q, k, decay)),
                               torch.stack(kda_ref_module._decayed_products(q, k, decay)),
                               rtol=1e-5, atol=1e-6)


def test_conv_fresh_matches_the_reference():
    torch.manual_seed(42)
    total, channels, kernel = sum(LENS), 6, 4
    x = torch.randn(total, channels, requires_grad=True)
    weight = torch.randn(channels, kernel, requires_grad=True)
    states = [torch.randn(6, channels, kernel - 1) for _ in range(2)]
    args = dict(cu_seqlens=_cu(LENS), state_slots=[3, 0, 5, 1, 2, 4], is_fresh=[True] * 6)
    ref = lambda: causal_conv1d_ref(x, weight, states[0], **args)  # noqa: E731
    fresh = lambda: conv_fresh(x, weight, states[1], **args)  # noqa: E731
    torch.testing.assert_close(fresh(), ref(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(states[1], states[0])
    probe = torch.randn(total, channels)
    for got, want in zip(_grads(fresh, [x, weight], probe), _grads(ref, [x, weight], probe),
                         strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_select_fresh_matches_the_reference():
    """Positive queries, keys and head weights: no two pools tie, so the sets are unique."""
    torch.manual_seed(42)
    lens, kpool, dim, heads, topk = [3, 4, 9, 33, 64, 17], 4, 8, 3, 8
    cu, total = _cu(lens), sum(lens)
    table = contiguous_page_table(len(lens), max(lens), PAGE_SIZE, "cpu")
    pool_keys = torch.zeros(table.numel() * PAGE_SIZE // kpool, dim)
    tail = torch.zeros(len(lens), kpool - 1, 2 * dim)
    slots = list(range(len(lens)))
    plan = write_plan(cu, [0] * len(lens), slots, len(lens), kpool, "cpu")
    indexer_write_ref(torch.rand(total, dim), torch.randn(total, dim), torch.randn(kpool, dim),
                      pool_keys, tail, table, plan, page_size=PAGE_SIZE)
    q, weights = torch.rand(total, heads, dim), torch.rand(total, heads)
    selects = select_plan(cu, [0] * len(lens), slots, kpool, "cpu")
    # The model passes 16-bit head weights and their scale (the kernels cast and scale them).
    args = dict(page_size=PAGE_SIZE, topk=topk, kpool=kpool, select_tail=True,
                weight_scale=heads ** -0.5)
    weights = weights.bfloat16()
    want = indexer_select_ref(q, weights, pool_keys, table, selects, **args)
    got = select_fresh(q, weights, pool_keys, table, selects, layout=Padded(cu, "cpu"), **args)
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


def test_compiled_mhc_forms_take_the_model_s_arguments():
    """The references the trainer compiles for mHC take the kernels' extra arguments (the
    input norm, a second block output) with the dispatchers' results."""
    from glmflash.kernels.hyper import hyper_post, hyper_post_ref, hyper_pre, hyper_pre_ref
    from tools.tiny_train_ops import _post_with_extra, _pre_with_norm

    gen = torch.Generator().manual_seed(0)
    streams, fn = torch.randn(3, 4, 16, generator=gen), torch.randn(24, 64, generator=gen)
    base, scale, weight = torch.randn(24, generator=gen), torch.rand(3, generator=gen), \
        torch.rand(16, generator=gen)
    kw = dict(norm_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=5)
    got = _pre_with_norm(hyper_pre_ref)(streams, fn, base, scale, norm=(weight, 1e-6), **kw)
    want = hyper_pre(streams, fn, base, scale, norm=(weight, 1e-6), **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    y = torch.randn(3, 16, generator=gen)
    assert torch.equal(_post_with_extra(hyper_post_ref)(y, streams, got[0], got[1], extra=2 * y),
                       hyper_post(y, streams, got[0], got[1], extra=2 * y))


def test_dense_experts_match_the_reference():
    torch.manual_seed(42)
    tokens, experts, hidden, width = 37, 8, 16, 12
    x = torch.randn(tokens, hidden, requires_grad=True)
    ids = torch.stack([torch.randperm(experts)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, requires_grad=True)
    w = [torch.randn(experts, width, hidden, requires_grad=True),
         torch.randn(experts, width, hidden, requires_grad=True),
         torch.randn(experts, hidden, width, requires_grad=True)]
    ref = lambda: fused_moe_ref(x, ids, weights, w[0], None, w[1], None, w[2], None,  # noqa: E731
                                limit=1.0)
    dense = lambda: dense_experts(x, ids, weights, *w, 1.0)  # noqa: E731
    torch.testing.assert_close(dense(), ref(), rtol=1e-5, atol=1e-5)
    probe = torch.randn(tokens, hidden)
    for got, want in zip(_grads(dense, [x, weights, *w], probe),
                         _grads(ref, [x, weights, *w], probe), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _all_grads(models) -> list[torch.Tensor]:
    """Every trained parameter's gradient (zeros where none reached it: no picture here)."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone()
            for m in models for p in m.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def host_batch(tmp_path_factory):
    from glmflash.tiny.tokenizer_files import write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    write_tiny_tokenizer(path)
    return pack_samples(make_samples(path, CONFIG, seed=3, count=6))


# SwiGLU's clamps bind at random weights (limit 1.0 in the tiny config), so many
# pre-activations lie within rounding (about 1e-6) of a limit, on either side of it in the two
# forms; one such clamp moves a gradient row by up to 1% of its largest entry (seen on an AMD
# EPYC: layer 2's shared expert, then every layer below it). The clamp is continuous, so the
# losses compare with it binding; the gradients at a limit no pre-activation reaches (the clamp
# is the same function on both sides, nothing batched).
UNCLAMPED = dataclasses.replace(CONFIG, swiglu_limit=1e4)


def _both_forms(config: ModelConfig, batch, backward: bool):
    """(plain losses, batched losses, plain grads, batched grads; grads None without
    `backward`). The batched run takes the slots the plain run's indexer selected, in the same
    order: the selection is discrete and has no gradient, and at random weights many pools tie
    or nearly tie (relu scores of 0), so the two sides' rounding could pick other pools for a
    few rows (4 of 1167 on an AMD EPYC; test_select_fresh_matches_the_reference checks the
    training selection where nothing ties)."""
    models = build_models(config, seed=0)
    selected = []

    def select_and_keep(*args, **kwargs):
        selected.append(indexer_select(*args, **kwargs))
        return selected[-1]

    indexer_module.indexer_select = select_and_keep
    try:
        with torch.set_grad_enabled(backward):
            want = forward_losses(*models, batch)
    finally:
        indexer_module.indexer_select = indexer_select
    want_grads = got_grads = None
    if backward:
        sum(want[:3]).backward()
        want_grads = _all_grads(models)
        for m in models:
            m.zero_grad(set_to_none=True)
    replay = iter(selected)
    with training_ops(*models), torch.set_grad_enabled(backward):
        # training_ops puts its own back
        indexer_module.indexer_select = lambda *args, **kwargs: next(replay)
        got = forward_losses(*models, batch)
        if backward:
            sum(got[:3]).backward()
            got_grads = _all_grads(models)
    assert next(replay, None) is None  # every selection was taken once
    return want, got, want_grads, got_grads


def _assert_losses_equal(got, want):
    assert got[3] == want[3]
    torch.testing.assert_close(torch.stack(got[:3]), torch.stack(want[:3]), rtol=1e-5, atol=0)


def test_training_step_equals_the_references(host_batch):
    """Losses and every gradient of one batch: batched forms against the plain CPU model."""
    torch.set_num_threads(2)  # conftest restores the count
    want, got, want_grads, got_grads = _both_forms(UNCLAMPED, host_batch, backward=True)
    _assert_losses_equal(got, want)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_training_losses_equal_the_references_with_clamps_binding(host_batch):
    torch.set_num_threads(2)
    want, got, _, _ = _both_forms(CONFIG, host_batch, backward=False)
    _assert_losses_equal(got, want)
    with torch.no_grad():
        unclamped = forward_losses(*build_models(UNCLAMPED, seed=0), host_batch)
    assert not torch.allclose(torch.stack(want[:3]), torch.stack(unclamped[:3]))  # they bind


def test_indexer_loss_is_the_mean_of_per_sequence_losses(host_batch):
    """The padded loss of a batch equals the mean of each layer's loss on each sequence alone
    (the same MLA inputs)."""
    model, _ = build_models(CONFIG, seed=0)
    lens = np.diff(host_batch.cu_seqlens).tolist()
    inputs = MlaInputs(model)
    state = ModelState(CONFIG, num_token_slots=len(lens) * 1024, num_state_slots=len(lens),
                       dtype=torch.float32, device="cpu")
    with torch.no_grad():
        model.hidden_states(packed_batch(lens, host_batch.ids, "cpu"), state)
        whole = indexer_loss(inputs.records)
        cu = host_batch.cu_seqlens
        per_layer = [torch.stack([_layer_loss(mla, x[cu[b]:cu[b + 1]],
                                              SimpleNamespace(cu_seqlens=[0, n]))
                                  for b, n in enumerate(lens)]).mean()
                     for mla, x, _ in inputs.records]
    inputs.remove()
    assert min(lens) >= CONFIG.index_kpool
    torch.testing.assert_close(whole, torch.stack(per_layer).mean(), rtol=1e-5, atol=1e-7)
