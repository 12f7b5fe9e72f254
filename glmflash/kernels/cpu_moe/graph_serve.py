"""CPU experts that a CUDA graph can call: a host callback hands a layer to a Numba loop.

A captured graph cannot run Python. Per MoE layer it holds a host node (`cuLaunchHostFunc`)
whose function, `hand_off_address()`, is a Numba `cfunc` that takes no GIL: it writes the layer
and row count into a control block, bumps the request count and waits until the serving loop
has finished that request. The serving loop, `serve_experts_nb`, runs without the GIL on a
thread of its own: it waits for requests, runs the grouped CPU kernels of `numba_kernels` over the
request's rows (pairs with a negative expert id are skipped) and publishes completion. Inputs and
output live in host buffers that the graph fills and reads with copies around the host node.

Control block (int64, one 64-byte line per word): requests made, layer and rows of the newest,
requests done, stop, failed. One request is in flight at a time: the host node returns only
once its request is done.
"""

from __future__ import annotations

import logging
import threading

import numba
import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from glmflash.kernels.cpu_moe.llvm_ir import exchange_seq_cst, fetch_add_seq_cst
from glmflash.kernels.cpu_moe.numba_kernels import _down_nb, _gate_up_nb, _group_nb

logger = logging.getLogger(__name__)

CTL_REQUESTS, CTL_LAYER, CTL_ROWS, CTL_DONE, CTL_STOP, CTL_FAILED = 0, 8, 16, 24, 32, 40
CTL_SIZE = 48
HAND_OFF_WORDS = 3
"""A host node's argument: int64 [control block address, layer, rows]."""
# Busy polls before each yield of the CPU; the loop sleeps once it has been idle this long.
SPINS_PER_YIELD = 256
IDLE_SPINS = 1 << 16
IDLE_SLEEP_US = 50

_I32, _I64 = ir.IntType(32), ir.IntType(64)


@njit(nogil=True, cache=True, inline="always")
def _load_nb(arr, index):
    """Sequentially consistent load of `arr[index]` (int64)."""
    return fetch_add_seq_cst(arr, index, 0)


@njit(nogil=True, cache=True, inline="always")
def _exchange_nb(arr, index, value):
    return exchange_seq_cst(arr, index, value)


@intrinsic
def _address_nb(typingctx, address):
    """An int64 address as a void pointer."""
    if not isinstance(address, types.Integer):
        raise TypingError(f"an address must be an integer, got {address}")

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(address), codegen


def _call_libc(builder, name: str, args: list) -> ir.Value:
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_I32, [a.type for a in args]), name)
    return builder.call(fn, args)


@intrinsic
def _sched_yield_nb(typingctx):
    """Give the CPU to another runnable thread."""
    def codegen(context, builder, sig, args):
        return _call_libc(builder, "sched_yield", [])
    return types.int32(), codegen


@intrinsic
def _usleep_nb(typingctx, micros):
    """Sleep this many microseconds."""
    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.int32)
        return _call_libc(builder, "usleep", [value])
    return types.int32(micros), codegen


@njit(nogil=True, cache=True, inline="always")
def _should_stop_nb(ctl):
    return _load_nb(ctl, CTL_STOP) != 0 or _load_nb(ctl, CTL_FAILED) != 0


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def _hand_off_cb(user):
    """The host node: request (layer, rows) and return once the serving loop has done it (or
    stopped). It runs on the driver's callback thread and must not call CUDA."""
    args = carray(user, (HAND_OFF_WORDS,), np.int64)
    ctl = carray(_address_nb(args[0]), (CTL_SIZE,), np.int64)
    _exchange_nb(ctl, CTL_LAYER, args[1])
    _exchange_nb(ctl, CTL_ROWS, args[2])
    ticket = _load_nb(ctl, CTL_REQUESTS) + 1
    _exchange_nb(ctl, CTL_REQUESTS, ticket)
    spins = 0
    while _load_nb(ctl, CTL_DONE) < ticket and not _should_stop_nb(ctl):
        spins += 1
        if spins % SPINS_PER_YIELD == 0:
            _sched_yield_nb()


def hand_off_address() -> int:
    """The host node's function (a `CUhostFn`)."""
    return _hand_off_cb.address


@njit(nogil=True, cache=True)
def _wait_request_nb(ctl, done):
    """Spin (then yield, then sleep) until a request beyond `done` arrives; False on stop."""
    spins = 0
    while _load_nb(ctl, CTL_REQUESTS) == done:
        if _should_stop_nb(ctl):
            return False
        spins += 1
        if spins >= IDLE_SPINS:
            _usleep_nb(IDLE_SLEEP_US)
        elif spins % SPINS_PER_YIELD == 0:
            _sched_yield_nb()
    return True


@njit(nogil=True, cache=True)
def serve_experts_nb(ctl, x, ids, weights, out, gate_w, gate_s, up_w, up_s, down_w, down_s,
                     decodes, swiglu_limit, block, gate_up_rows, down_rows, cpu_masks, scratch,
                     acc, task_counter, counts, hit_ids, pair_offsets, pair_token_ids,
                     pair_weights, h, no_trace_2d, no_trace_1d):
    """Serve requests until stopped: out[:rows] = the CPU experts of the request's layer over
    x[:rows] (f32), ids[:rows] (int64, < 0 skipped), weights[:rows] (f32).

    The per-layer weights come as tuples indexed by layer (`decodes` [L] int64 per layer); the
    pool split, masks and scratch are those of `NumbaMoeExperts` (every layer has one shape);
    the empty `no_trace_*` arrays turn the kernels' worker traces off.
    """
    done = _load_nb(ctl, CTL_DONE)
    while _wait_request_nb(ctl, done):
        layer = _load_nb(ctl, CTL_LAYER)
        rows = _load_nb(ctl, CTL_ROWS)
        out[:rows] = 0.0
        num_hit = _group_nb(ids[:rows], weights[:rows], counts, hit_ids, pair_offsets,
                            pair_token_ids, pair_weights)
        if num_hit:
            _gate_up_nb(x[:rows], gate_w[layer], gate_s[layer], up_w[layer], up_s[layer],
                        hit_ids[:num_hit], pair_offsets, pair_token_ids, swiglu_limit,
                        decodes[layer], block, gate_up_rows, cpu_masks, scratch, acc,
                        task_counter, no_trace_2d, h)
            _down_nb(h, down_w[layer], down_s[layer], hit_ids[:num_hit], pair_offsets,
                     pair_token_ids, pair_weights, decodes[layer], block, down_rows, cpu_masks,
                     scratch, acc, task_counter, no_trace_1d, out[:rows])
        done += 1
        _exchange_nb(ctl, CTL_DONE, done)


class ExpertServer:
    """The serving loop on its own thread, over the CPU kernels of every MoE layer (one shape)
    and host buffers owned by the caller: x `[R, D]` f32, ids and weights `[R, k]` int64 / f32,
    out `[R, D]` f32, R the most rows of a request."""

    def __init__(self, kernels: list, x: np.ndarray, ids: np.ndarray, weights: np.ndarray,
                 out: np.ndarray) -> None:
        first = kernels[0]
        self.num_threads = first.num_threads
        self.ctl = np.zeros(CTL_SIZE, np.int64)
        self._hand_offs: dict[tuple[int, int], np.ndarray] = {}
        self.error: BaseException | None = None
        num_pairs = ids.size
        stacked = [tuple(getattr(k, name) for k in kernels)
                   for name in ("gate_w", "gate_s", "up_w", "up_s", "down_w", "down_s")]
        # The pair buffers are this server's; the kernels' scratch and task counters are
        # shared with layer 0's eager forward, which never runs while a graph replays.
        self._args = (
            self.ctl, x, ids, weights, out, *stacked,
            np.array([k.decode for k in kernels], np.int64), np.float32(first.swiglu_limit),
            first.block, first._gate_up_rows, first._down_rows, first._cpu_masks, first._scratch,
            first._acc, first._task_counter, np.zeros(first.num_experts, np.int64),
            np.zeros(num_pairs, np.int64), np.zeros(num_pairs + 1, np.int64),
            np.zeros(num_pairs, np.int64), np.zeros(num_pairs, np.float32),
            np.zeros((num_pairs, first.inter), np.float32), np.zeros((0, 0), np.int64),
            np.zeros(0, np.int64))
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Compile (or load) the loop and start its thread (again after `stop`: the stop and
        failure flags are cleared first)."""
        self.ctl[CTL_STOP] = self.ctl[CTL_FAILED] = 0
        self.error = None
        self._thread = threading.Thread(target=self._serve, name="glmflash-graph-experts",
                                        daemon=True)
        self._thread.start()

    def hand_off_arg(self, layer: int, rows: int) -> int:
        """The address to pass to the host node that requests (layer, rows); valid while this
        server lives."""
        key = (layer, rows)
        if key not in self._hand_offs:
            self._hand_offs[key] = np.array([self.ctl.ctypes.data, layer, rows], np.int64)
        return self._hand_offs[key].ctypes.data

    @property
    def failed(self) -> bool:
        return bool(self.ctl[CTL_FAILED])

    def stop(self) -> None:
        self.ctl[CTL_STOP] = 1
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _serve(self) -> None:
        numba.set_num_threads(self.num_threads)  # per thread: this one launches the kernels
        try:
            serve_experts_nb(*self._args)
        except BaseException as e:  # noqa: BLE001 - reported through `failed` and `error`
            self.error = e
            self.ctl[CTL_FAILED] = 1
            logger.exception("the CPU experts of the captured decode failed")
