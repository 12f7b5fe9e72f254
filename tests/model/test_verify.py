"""The verify forward of speculative decoding on the trained tiny model (fp32, CPU):

* after committing any accepted position, the KDA recurrent state, the conv window and the
  indexer tail of every layer are, bit for bit, those of steps of one token each over the same
  per-token inputs (the varlen prefill entry points, not the decode kernels the verify uses);
* the MTP layer's logits computed incrementally over its own cache (chunks, then one position
  at a time, as the engine drafts) equal one forward over the whole sequence (the composition
  the layer was trained with). transformers' glm5_next has no MTP layer, so the oracle cannot
  check it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import glmflash.model.verify as verify_module
from glmflash.kernels.indexer import indexer_write, write_plan
from glmflash.kernels.kda import causal_conv1d, kda, kda_gates
from glmflash.model.forward_batch import build_forward_batch, contiguous_page_table, token_slots_of
from glmflash.model.mtp import GlmMtp, load_mtp, with_mtp_layer
from glmflash.model.state import ModelState
from glmflash.model.verify import (
    VerifyScratch,
    commit,
    commit_on_device,
    pack_verify,
    verify_batch,
    verify_rows,
)
from glmflash.tiny.embedded import embedded_checkpoint
from glmflash.tokenizer import Tokenizer
from tests.conftest import LOGIT_ATOL, load_tiny

TRAINED = embedded_checkpoint()
PAGE = 16
NUM_DRAFTS = 3
# 21 cached tokens: the verified positions 21..24 complete the k-pool 20..23 at the third.
PROMPT = Tokenizer.from_dir(TRAINED).encode(
    "Once upon a time, a little fox lived in the woods with her mother and her two brothers.")[:22]


@pytest.fixture(scope="module")
def model():
    return load_tiny(TRAINED)


def _batch(tokens: list[int], start: int, table: torch.Tensor, logit_rows: list[int] | None = None):
    slots = token_slots_of(table[0].tolist(), start, len(tokens), PAGE)
    return build_forward_batch(tokens, slots, [0, len(tokens)], [start], [0], table, PAGE,
                               logit_seqs=[] if logit_rows else None,
                               extra_logit_rows=logit_rows)


def _state_copy(state: ModelState) -> dict:
    return {name: {i: t.clone() for i, t in getattr(state, name).items()}
            for name in ("recurrent", "conv", "index_tail", "pool_keys")}


class Recorder:
    """The verify's calls of the three state kernels, with their inputs (the whole forward's
    rows: each call covers every position)."""

    STATE_ARG = {"kda_verify": 5, "causal_conv1d_verify": 2, "indexer_write_verify": 4}

    def __init__(self, monkeypatch, state: ModelState) -> None:
        self.calls = []
        self.layer_of = {id(t): i for name in ("recurrent", "conv", "index_tail")
                         for i, t in getattr(state, name).items()}
        for name in self.STATE_ARG:
            monkeypatch.setattr(verify_module, name, self._wrap(name, getattr(verify_module, name)))

    def _wrap(self, name, fn):
        def record(*args, **kwargs):
            copy = lambda a: a.clone() if isinstance(a, torch.Tensor) else a  # noqa: E731
            self.calls.append((name, self.layer_of[id(args[self.STATE_ARG[name]])],
                               [copy(a) for a in args],
                               {key: copy(a) for key, a in kwargs.items()}))
            return fn(*args, **kwargs)
        return record


def _one_token_steps(calls, ref: dict, table: torch.Tensor, num_positions: int,
                     kpool: int) -> None:
    """Replay the recorded per-token inputs of the first `num_positions` positions (one
    sequence: rows 0, 1, ...), one token per step, through the varlen entry points (as a
    prefill of one token would run them)."""
    for name, layer, args, kwargs in calls:
        for row in range(num_positions):
            if name == "kda_verify":
                q, k, v, g, beta = (t[[row]] for t in args[:5])
                gates = kwargs.get("gates")
                if gates is not None:  # g and beta came as the gates' pre-activations
                    g, beta = kda_gates(g, gates.dt_bias, gates.a_log, beta, gates.lower_bound)
                kda(q, k, v, g, beta, ref["recurrent"][layer], [0, 1], [0], [False])
            elif name == "causal_conv1d_verify":
                causal_conv1d(args[0][[row]], args[1], ref["conv"][layer], [0, 1], [0], [False])
            else:
                keys, gates, ape = args[0][[row]], args[1][[row]], args[2]
                pos = int(args[7][row])
                plan = write_plan([0, 1], [pos], [0], ref["index_tail"][layer].shape[0], kpool,
                                  keys.device)
                indexer_write(keys, gates, ape, ref["pool_keys"][layer],
                              ref["index_tail"][layer], table, plan, page_size=PAGE)


def test_committed_state_equals_one_token_steps_bit_for_bit(model, monkeypatch):
    config = model.config
    state = ModelState(config, num_token_slots=4 * 64, num_state_slots=1, dtype=torch.float32,
                       device="cpu")
    table = contiguous_page_table(1, 64, PAGE, "cpu")
    cached = len(PROMPT) - 1
    model(_batch(PROMPT[:-1], 0, table), state)
    before = _state_copy(state)
    recorder = Recorder(monkeypatch, state)
    tokens = [PROMPT[-1], 11, 12, 13]
    scratch = VerifyScratch(config, state, 1, NUM_DRAFTS)
    slots = token_slots_of(table[0].tolist(), cached, len(tokens), PAGE).tolist()
    num_pools = (cached + len(tokens)) // config.index_kpool
    rows = verify_rows([tokens], [slots], [cached], [0], num_pools)
    fb = verify_batch(torch.from_numpy(pack_verify(rows, save=True)), rows.num_tokens, table,
                      PAGE, num_pools, scratch)
    model(fb, state)
    after = _state_copy(state)
    for accepted in range(NUM_DRAFTS + 1):
        for name in after:
            for i, t in getattr(state, name).items():
                t.copy_(after[name][i])
        commit(state, scratch, [0], [len(tokens)], [accepted])
        ref = {name: {i: t.clone() for i, t in d.items()} for name, d in before.items()}
        _one_token_steps(recorder.calls, ref, table, accepted + 1, config.index_kpool)
        for name in ("recurrent", "conv", "index_tail"):
            for i, t in getattr(state, name).items():
                assert torch.equal(t, ref[name][i]), f"{name} of layer {i}, {accepted} accepted"
                # The check can fail: before the commit the slot holds the last position's.
                if accepted < NUM_DRAFTS and name != "index_tail":
                    assert not torch.equal(after[name][i], ref[name][i])


def test_mtp_logits_incremental_equal_one_forward(model):
    config = with_mtp_layer(model.config)
    mtp = GlmMtp(model.config, torch.float32)
    load_mtp(mtp, TRAINED)
    mtp.eval()
    tokens = PROMPT + [3, 4, 5]
    table = contiguous_page_table(1, 64, PAGE, "cpu")
    with torch.inference_mode():
        state = ModelState(config, num_token_slots=4 * 64, num_state_slots=1,
                           dtype=torch.float32, device="cpu")
        hidden = model.hidden_states(_batch(tokens, 0, table), state)
        embeds = model.text.embed_tokens(torch.tensor(tokens[1:]))
        n = len(tokens) - 1
        whole = mtp.logits(model, mtp.layer.hidden(hidden[:n], embeds, _batch(tokens[1:], 0,
                                                                               table), state))
        state = ModelState(config, num_token_slots=4 * 64, num_state_slots=1,
                           dtype=torch.float32, device="cpu")
        model.hidden_states(_batch(tokens, 0, table), state)
        parts, start = [], 0
        for stop in (9, 17, *range(18, n + 1)):
            fb = _batch(tokens[start + 1: stop + 1], start, table)
            out = mtp.layer.hidden(hidden[start:stop], embeds[start:stop], fb, state)
            parts.append(mtp.logits(model, out))
            start = stop
    incremental = torch.cat(parts)
    assert np.isfinite(whole.numpy()).all()
    assert (incremental - whole).abs().max() < LOGIT_ATOL


def test_commit_on_device_takes_the_accepted_copy_unless_all_drafts_were():
    """Per sequence: fewer accepted than its drafts -> the scratch copy of that position; all
    accepted, or no drafts at all -> the slot as it is. Each layer takes its own copies (one
    launch per kind covers every layer), and the MTP layer's tail, which the scratch does not
    keep, is left alone."""
    config = load_tiny(TRAINED).config
    state = ModelState(with_mtp_layer(config), num_token_slots=64, num_state_slots=4,
                       dtype=torch.float32, device="cpu")
    scratch = VerifyScratch(config, state, 4, 2)
    mtp_layer = len(config.layer_types)
    assert mtp_layer in state.index_tail and mtp_layer not in scratch.index_tail
    for live, saved in ((state.recurrent, scratch.recurrent), (state.conv, scratch.conv),
                        (state.index_tail, scratch.index_tail)):
        for layer, t in live.items():
            t.copy_(1000 * layer + torch.arange(t.shape[0], dtype=t.dtype).view(
                -1, *[1] * (t.dim() - 1)))
            if layer in saved:
                saved[layer].copy_(1000 * layer + 100 + torch.arange(8, dtype=t.dtype).view(
                    4, 2, *[1] * (t.dim() - 1)))
    slots = torch.tensor([3, 2, 1, 0])
    accepted, drafts = torch.tensor([0, 1, 2, 0]), torch.tensor([2, 2, 2, 0])
    commit_on_device(state, scratch, slots, accepted, drafts)
    # slot 3 <- row 0 step 0 (100); slot 2 <- row 1 step 1 (103); slots 1, 0 unchanged.
    for live in (state.recurrent, state.conv, state.index_tail):
        for layer, t in live.items():
            got = [float(t[i].flatten()[0]) - 1000 * layer for i in range(4)]
            assert got == ([0.0, 1.0, 2.0, 3.0] if layer == mtp_layer else
                           [0.0, 1.0, 103.0, 100.0]), f"layer {layer}"
