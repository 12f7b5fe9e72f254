"""What CUDA-graph decode decides without a GPU: the sizes captured, where graphs cannot run,
the selection widths, the padding rows, and an engine asked for graphs on a CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from glmflash import Engine, SamplingParams
from glmflash.engine.cuda_graph import graph_batch_sizes, graphs_unsupported
from glmflash.engine.model_runner import selection_widths


def test_batch_sizes_are_capped():
    assert graph_batch_sizes(None, None, 16, None) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes((4, 1, 2, 2), None, 16, None) == [1, 2, 4]
    assert graph_batch_sizes(None, 6, 16, None) == [1, 2, 4]
    assert graph_batch_sizes(None, None, 64, 9) == [1, 2, 4, 8]
    assert graph_batch_sizes((64,), None, 16, None) == []


def test_where_graphs_cannot_run(monkeypatch):
    assert "CUDA device" in graphs_unsupported(torch.device("cpu"))
    monkeypatch.setenv("GLMFLASH_KERNEL_KDA", "ref")
    assert "['kda']" in graphs_unsupported(torch.device("cuda"))
    monkeypatch.delenv("GLMFLASH_KERNEL_KDA")
    assert graphs_unsupported(torch.device("cuda")) is None


def test_selection_widths_grow_by_four_to_the_longest_sequence():
    assert selection_widths(262144) == [4096, 16384, 65536, 262144]
    assert selection_widths(100000) == [4096, 16384, 65536, 100000]
    assert selection_widths(2048) == [2048]
    assert selection_widths(4096) == [4096]


def test_cpu_engine_with_graph_flags_decodes_eagerly(tiny_dirs, caplog):
    caplog.set_level(logging.INFO, logger="glmflash.engine.engine")
    engine = Engine(tiny_dirs["embedded"], device="cpu", cuda_graph_bs=[1, 2],
                    max_running_requests=2, background_loop=False, skip_kernel_warmup=True)
    try:
        assert engine.runner.graphs is None
        assert "without CUDA graphs: CUDA graphs need a CUDA device" in caplog.text
        runner = engine.runner
        pad = runner.padding_rows(2)
        assert set(pad.state_slots) == {runner.dummy_slot}
        assert set(pad.token_slots) == {runner.dummy_page * runner.page_size}
        assert runner.page_table[runner.dummy_slot].eq(runner.dummy_page).all()
        assert runner.dummy_slot == engine.cache.plan.num_state_slots
        out = engine.generate(["a b c", "d"], SamplingParams(max_tokens=4, temperature=0))
        assert all(len(r.choices[0].token_ids) == 4 for r in out)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("bad", [dict(cuda_graph_bs=[0]), dict(cuda_graph_max_bs=0)])
def test_bad_graph_options_are_refused(tiny_dirs, bad):
    with pytest.raises(ValueError, match="cuda_graph"):
        Engine(tiny_dirs["embedded"], device="cpu", background_loop=False, **bad)
