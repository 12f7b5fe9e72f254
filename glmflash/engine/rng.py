"""Counter-based random numbers for sampling: a pure function of (key, output position, token id).

A seeded request draws the same numbers whatever else is in the batch and on any device: nothing
depends on a generator's state, on the row's place in the batch or on the order of draws. The
hash is splitmix64 written with int64 torch ops (torch has no uint64 arithmetic): multiplication
wraps mod 2^64 on CPU and CUDA, and right shifts are made logical by masking.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def to_int64(value: int) -> int:
    """The int64 with the low 64 bits of `value` (any Python int is a valid key)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x >> n) & ((1 << (64 - n)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 bits: a bijection that spreads every input bit."""
    x = (x ^ _shift_right(x, 30)) * to_int64(_MUL1)
    x = (x ^ _shift_right(x, 27)) * to_int64(_MUL2)
    return x ^ _shift_right(x, 31)


def exponential_noise(keys: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws `[S, V]` (fp32) for S rows of (key, output position), one per token id.

    Row r, token t is splitmix64's output number t of the stream seeded by hash(key, position).
    """
    golden = to_int64(_GOLDEN)
    rows = mix64(mix64(keys) + (positions + 1) * golden)  # [S]
    tokens = torch.arange(vocab_size, device=keys.device) * golden  # [V]
    bits = mix64(rows[:, None] + tokens)  # [S, V]
    # NOTE: 53 bits in fp64 keep u in (0, 1) and the smallest draws of a large vocabulary (they
    # decide the race) distinct; 24-bit fp32 uniforms put them on a grid coarse enough to tie.
    uniform = (_shift_right(bits, 11).double() + 0.5) * 2.0**-53
    return (-torch.log(uniform)).float()
