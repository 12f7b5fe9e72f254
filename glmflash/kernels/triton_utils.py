"""What the Triton launchers share: the jit wrapper, module constants kernels read, interpreter
detection, the operand type and precision of products, the device's SM count, per-device
arrival counters for launches whose last program finishes the work, and the grouped tile order
of the GEMM kernels."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package must import without triton; the launchers need it
    triton = None


def jit(fn=None, *, do_not_specialize: tuple[str, ...] = ()):
    """`triton.jit` where triton exists (the plain function otherwise, so modules import).

    `do_not_specialize`: integer arguments that change from step to step (context lengths);
    specialising on them (== 1, % 16) would recompile the kernel in the middle of decoding.
    """
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is None:
        return fn
    if do_not_specialize:
        return triton.jit(fn, do_not_specialize=list(do_not_specialize))
    return triton.jit(fn)


def constexpr(value):
    """A module constant that kernels may read (`tl.constexpr`; the plain value without triton)."""
    return value if triton is None else triton.language.constexpr(value)


def interpreting() -> bool:
    """Running under TRITON_INTERPRET (numpy on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_operand_type(dtype: torch.dtype):
    """Operand type of `tl.dot` for tensors of `dtype`: the 16-bit model type, fp32 for fp32
    models and under the interpreter (whose tl.dot multiplies bf16 bit patterns as integers)."""
    if dtype == torch.float32 or interpreting():
        return triton.language.float32
    return triton.language.float16 if dtype == torch.float16 else triton.language.bfloat16


def product_precision(dtype: torch.dtype) -> str:
    """`input_precision` of `tl.dot` for tensors of `dtype`: fp32 models keep fp32 products
    (TF32 would cost ~1e-3), 16-bit models round as their operands do."""
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def gluon_async_load(module):
    """Gluon's async load of `module` (`tma` or `async_copy`): Triton 3.6 (the H200's) names it
    `async_copy_global_to_shared`; later versions renamed it `async_load` and made the old name
    raise."""
    return getattr(module, "async_load", None) or module.async_copy_global_to_shared


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 stands in for the interpreter)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


class ArrivalCounters:
    """Zeroed int32 counters per device that launches count their finished programs in; the
    last program of a tile resets its counter, so every launch leaves them at zero. Launches
    sharing one set must run in stream order."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device, tiles: int) -> torch.Tensor | None:
        """The device's counters, or None where they cannot be made now (a first launch inside
        CUDA-graph capture) or are too few for `tiles`."""
        counters = self.by_device.get(device)
        if counters is None:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    if torch.cuda.is_current_stream_capturing():
                        return None
            counters = self.by_device[device] = torch.zeros(self.slots, dtype=torch.int32,
                                                            device=device)
        return counters if tiles <= counters.numel() else None

    def __getitem__(self, device: torch.device) -> torch.Tensor:
        return self.by_device[device]


@jit
def grouped_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of program `pid` in grouped order: GROUP_M row blocks sweep
    each column tile together, so they share its weights while they are in L2."""
    width = GROUP_M * num_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m
