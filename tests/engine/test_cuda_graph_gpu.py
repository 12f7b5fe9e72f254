"""Decode replayed from CUDA graphs gives the tokens of eager decode, all-GPU and hybrid, while
requests arrive, finish and are aborted; padding rows write only the runner's reserve."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from glmflash import Engine, SamplingParams

pytestmark = pytest.mark.gpu

# (step, request, prompt length, max tokens) of arrivals; (step, request) of aborts. Running
# batches go 2 -> 5 -> 7 -> 6 -> 4 ... so replays cross the captured sizes, pad and shrink.
ARRIVALS = [(0, "a", 30, 24), (0, "b", 5, 8), (3, "c", 41, 30), (3, "d", 9, 3), (3, "e", 12, 40),
            (6, "f", 70, 20), (6, "g", 3, 12)]
ABORTS = [(10, "e")]
HYBRID = {"all-gpu": {}, "hybrid-0": dict(kt_num_gpu_experts=0, kt_cpuinfer=2),
          "hybrid-3": dict(kt_num_gpu_experts=3, kt_cpuinfer=2)}


def _prompt(name: str, length: int) -> list[int]:
    seed = ord(name)
    return [(seed * 31 + 7 * j) % 1000 + 1 for j in range(length)]


def _engine(path, **options) -> Engine:
    return Engine(path, device="cuda", dtype="float32", context_length=512,
                  max_running_requests=8, background_loop=False, **options)


def _run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = defaultdict(list)
    arrivals, aborts = list(ARRIVALS), dict(ABORTS)
    step = 0
    while arrivals or engine.scheduler.has_work or engine.num_pending:
        while arrivals and arrivals[0][0] <= step:
            _, name, length, max_tokens = arrivals.pop(0)
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(_prompt(name, length), params,
                               lambda d, name=name: tokens[name].extend(d.token_ids),
                               request_id=name)
        for when, name in list(aborts.items()):
            if when == step:
                engine.abort(name)
        engine.step()
        engine.check_integrity()
        step += 1
    return dict(tokens)


@pytest.mark.parametrize("mode", list(HYBRID))
def test_graph_decode_tokens_equal_eager(tiny_dirs, mode):
    path = tiny_dirs["embedded"]
    eager = _engine(path, disable_cuda_graph=True, **HYBRID[mode])
    try:
        want = _run(eager)
    finally:
        eager.shutdown()
    graphs = _engine(path, cuda_graph_bs=[1, 2, 4, 8], **HYBRID[mode])
    try:
        got = _run(graphs)
        replays = graphs.runner.graphs.num_replays
    finally:
        graphs.shutdown()
    assert replays >= 20, "the run should decode mostly from graphs"
    assert got == want
    assert len(got["e"]) < 40, "the aborted request should have stopped early"


def _snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    state = engine.runner.state
    tensors = {}
    for name in ("latent", "pool_keys", "index_tail", "recurrent", "conv"):
        for layer, t in getattr(state, name).items():
            tensors[f"{name}.{layer}"] = t.clone()
    return tensors


@pytest.mark.parametrize("mode", ["all-gpu", "hybrid-0"])
def test_padding_rows_write_only_the_reserve(tiny_dirs, mode):
    engine = _engine(tiny_dirs["embedded"], cuda_graph_bs=[4], **HYBRID[mode])
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        for name in "xyz":
            engine.add_request(_prompt(name, 20), params, lambda d: None, request_id=name)
        while any(s.num_uncomputed_tokens != 1 for s in engine.scheduler.running) \
                or len(engine.scheduler.running) < 3:
            engine.step()
        runner, seqs = engine.runner, list(engine.scheduler.running)
        before, replays = _snapshot(engine), runner.graphs.num_replays
        engine.step()  # 3 decodes replayed at size 4: one padding row
        assert runner.graphs.num_replays == replays + 1
        after = _snapshot(engine)
        page, kpool = runner.page_size, runner.kpool
        live_slots = {s.state_slot for s in seqs}
        live_pages = {p for s in seqs for p in s.page_ids}
        token_rows = torch.arange(runner.state.num_token_slots, device="cuda")
        touched_tokens = torch.isin(token_rows // page, torch.tensor(
            sorted(live_pages | {runner.dummy_page}), device="cuda"))
        for name, old in before.items():
            kind = name.split(".")[0]
            if kind in ("latent", "pool_keys"):
                rows = touched_tokens if kind == "latent" else touched_tokens[::kpool]
            else:
                rows = torch.zeros(old.shape[0], dtype=torch.bool, device="cuda")
                rows[sorted(live_slots | {runner.dummy_slot})] = True
            assert torch.equal(after[name][~rows], old[~rows]), f"{name} changed outside the batch"
    finally:
        engine.shutdown()
