"""The CPU experts' serving loop of CUDA-graph decode, driven here the way a host node drives
it: its C callback (a Numba cfunc) called through ctypes, without a GPU."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from glmflash.kernels.cpu_moe.graph_serve import (
    CTL_FAILED,
    CTL_REQUESTS,
    ExpertServer,
    hand_off_address,
)
from glmflash.kernels.cpu_moe.numba_impl import NumbaMoeExperts
from tests.kernels.test_cpu_moe import make_experts

NUM_EXPERTS, HIDDEN, INTER, TOP_K, MAX_ROWS = 6, 200, 72, 2, 4


@pytest.fixture(scope="module")
def server():
    gen = torch.Generator().manual_seed(5)
    kernels = [NumbaMoeExperts(*make_experts(NUM_EXPERTS, HIDDEN, INTER, gen), swiglu_limit=0.7,
                               num_threads=2) for _ in range(3)]
    buffers = (np.zeros((MAX_ROWS, HIDDEN), np.float32), np.zeros((MAX_ROWS, TOP_K), np.int64),
               np.zeros((MAX_ROWS, TOP_K), np.float32), np.zeros((MAX_ROWS, HIDDEN), np.float32))
    serving = ExpertServer(kernels, *buffers)
    serving.start()
    yield serving, kernels, buffers
    serving.stop()


def _host_node():
    return ctypes.CFUNCTYPE(None, ctypes.c_void_p)(hand_off_address())


def test_requests_match_each_layers_kernel(server):
    serving, kernels, (x, ids, weights, out) = server
    gen = np.random.default_rng(0)
    call = _host_node()
    for layer, rows in ((2, 3), (0, 4), (1, 1), (2, 4)):
        x[:] = gen.standard_normal(x.shape)
        ids[:] = gen.integers(-1, NUM_EXPERTS, ids.shape)  # -1: an expert computed elsewhere
        weights[:] = gen.random(weights.shape)
        out[:] = np.nan
        call(serving.hand_off_arg(layer, rows))
        want = kernels[layer].forward(torch.from_numpy(x[:rows]), torch.from_numpy(ids[:rows]),
                                      torch.from_numpy(weights[:rows])).numpy()
        np.testing.assert_array_equal(out[:rows], want)
        assert np.isnan(out[rows:]).all(), "rows beyond the request must stay untouched"
    assert serving.ctl[CTL_REQUESTS] == 4 and not serving.failed


def test_a_failing_request_releases_the_host_node():
    gen = torch.Generator().manual_seed(6)
    kernel = NumbaMoeExperts(*make_experts(NUM_EXPERTS, HIDDEN, INTER, gen), swiglu_limit=0.7,
                             num_threads=2)
    ids = np.full((1, TOP_K), NUM_EXPERTS + 3, np.int64)  # out of range: the kernel raises
    serving = ExpertServer([kernel], np.zeros((1, HIDDEN), np.float32), ids,
                           np.ones((1, TOP_K), np.float32), np.zeros((1, HIDDEN), np.float32))
    serving.start()
    try:
        _host_node()(serving.hand_off_arg(0, 1))  # returns instead of waiting forever
        assert serving.failed and serving.ctl[CTL_FAILED] == 1
        assert "out of range" in str(serving.error)
    finally:
        serving.stop()


def test_a_server_started_again_after_stop_serves():
    gen = torch.Generator().manual_seed(7)
    kernel = NumbaMoeExperts(*make_experts(NUM_EXPERTS, HIDDEN, INTER, gen), swiglu_limit=0.7,
                             num_threads=2)
    x, out = np.ones((1, HIDDEN), np.float32), np.zeros((1, HIDDEN), np.float32)
    ids, weights = np.zeros((1, TOP_K), np.int64), np.ones((1, TOP_K), np.float32)
    serving = ExpertServer([kernel], x, ids, weights, out)
    call = _host_node()
    want = kernel.forward(torch.from_numpy(x), torch.from_numpy(ids),
                          torch.from_numpy(weights)).numpy()
    for _ in range(2):
        serving.start()
        try:
            out[:] = np.nan
            call(serving.hand_off_arg(0, 1))
            np.testing.assert_array_equal(out, want)
        finally:
            serving.stop()
