"""Compile the Gluon kernels (the FP8 GEMM, glmflash/kernels/fp8_gemm/gluon_sm90.py, and the
sparse MLA, glmflash/kernels/sparse_mla/gluon_sm90.py) for sm_90 without a GPU and check what
ptxas says of them: no spills (beyond the partition entry's, `ENTRY_SPILL_BYTES`), no
serialised wgmma (ptxas's C7515: a non-wgmma instruction writing the registers of a wgmma in
flight makes it wait for every wgmma, which cost a quarter of the GEMM's rate when it
happened), and, in the SASS, no wgmma sequence waiting on a global load issued in its own
loop step (`fresh_loads_in_wgmma`).

    python tools/gluon_check.py [--only gemm|sparse_mla]

Prints one line per form; exits 1 if a form spills, serialises or stalls so. The installed
Triton compiles (the device's Triton 3.6 and this machine's newer one both build it). Triton's
JIT asks its driver for the target, so a stand-in driver that names sm_90 is installed for the
duration (run it in its own process: tests/kernels/test_gluon_sm90.py does).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

# A compile for a real target: under the interpreter (the CPU tests set it) the Triton helpers
# the kernel calls would be interpreted functions, which Gluon cannot call.
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.runtime import driver  # noqa: E402

from glmflash.kernels.fp8_gemm import gluon_sm90 as g  # noqa: E402
from glmflash.kernels.sparse_mla import gluon_sm90 as mla  # noqa: E402
from glmflash.kernels.sparse_mla.plan import SplitPlan  # noqa: E402


class Sm90Driver:
    """Just enough of a CUDA driver for `JITFunction.warmup`: the target and a device."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


def compile_form(mode) -> str:
    """PTX of the kernel for one epilogue form at release-like shapes (CPU tensors stand in),
    with the arguments `gluon_sm90.kernel_call` gives the launch."""
    rows, n, k, experts = 1024, 2048, 4096, 4
    gated = mode == g.GATED
    a = torch.empty(rows, k, dtype=torch.float8_e4m3fn)
    a_s = torch.empty(k // 128, rows).t()
    b = torch.empty(experts, n, k, dtype=torch.float8_e4m3fn)
    b_s = torch.empty(experts, n // 128, k // 128)
    out = torch.empty(rows, n, dtype=torch.float8_e4m3fn if gated else torch.bfloat16)
    out_s = torch.empty(n // 128, rows) if gated else None
    row_map = torch.empty(rows, dtype=torch.int32) if mode == g.SCATTER_ROWS else None
    blocks = torch.empty(rows // 128, dtype=torch.int32) if mode != g.STORE_ROWS else None
    grid, args, kwargs = g.kernel_call(
        a, a_s, b, b_s, b if gated else None, b_s if gated else None, out, out_s, row_map,
        blocks, rows=rows, n=n, k=k, num_row_blocks=rows // 128, num_valid=rows, limit=7.0,
        mode=mode, config=g.GLUON_CONFIG)
    return g.block_fp8_gemm_kernel.warmup(*args, grid=grid, **kwargs).asm["ptx"]


def compile_sparse_mla(split: bool) -> str:
    """PTX of the sparse MLA at the release shapes: 8 decode queries split 16 ways, or one
    query unsplit (as a prefill program)."""
    queries, heads, rank, width = 8, 64, mla.RANK, 2051
    q = torch.empty(queries, heads, rank, dtype=torch.bfloat16)
    latent = torch.empty(1 << 17, rank, dtype=torch.bfloat16)
    slots = torch.empty(queries, width, dtype=torch.int32)
    out = torch.empty_like(q)
    splits = 16 if split else 1
    plan = SplitPlan(splits, 32 // splits, 0, 32)
    parts = (torch.empty(queries * splits, heads, rank, dtype=torch.bfloat16),
             torch.empty(queries * splits, heads)) if split else (out, out)
    grid, args, kwargs = mla.kernel_call(q, latent, slots, out, *parts, 0.1, plan,
                                         mla.GLUON_SPARSE_MLA_CONFIG, sms=132)
    return mla.sparse_mla_ws_kernel.warmup(*args, grid=grid, **kwargs).asm["ptx"]


FORMS = {
    "gemm": ((lambda: compile_form(g.STORE_ROWS), "rows"),
             (lambda: compile_form(g.SCATTER_ROWS), "scatter"),
             (lambda: compile_form(g.GATED), "gated")),
    "sparse_mla": ((lambda: compile_sparse_mla(True), "sparse MLA split"),
                   (lambda: compile_sparse_mla(False), "sparse MLA unsplit")),
}


ENTRY_SPILL_BYTES = 8
"""Spill stores allowed: ptxas may compute a value the partitions share before they set their
register counts and carry it through the stack (the persistent sparse MLA: two 4-byte stores
at kernel entry, one load in each of two partitions; seen in cuobjdump's SASS). A spill in a
loop is larger than this."""


def spill_store_bytes(line: str) -> int:
    """Bytes of spill stores in one ptxas -v line (0 if it names none)."""
    found = re.search(r"(\d+) bytes spill stores", line)
    return int(found.group(1)) if found else 0


def ptxas_report(ptx: str, workdir: Path) -> list[str]:
    """ptxas -v's lines on spills and serialised wgmma (the cubin is left in workdir)."""
    source = workdir / "kernel.ptx"
    source.write_text(ptx)
    done = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(source), "-o",
                           str(workdir / "kernel.cubin")], capture_output=True, text=True,
                          check=True)
    return [line for line in done.stderr.splitlines() if "spill" in line or "C7515" in line]


SASS_LINE = re.compile(
    r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?)\s*;")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of each SASS instruction."""
    return [(int(m.group(1), 16), m.group(2), m.group(3))
            for m in map(SASS_LINE.match, sass.splitlines()) if m]


def fresh_loads_in_wgmma(sass: str) -> int:
    """Instructions inside a wgmma sequence (WARPGROUP.ARRIVE to the group's last product)
    that read the result of a global load issued since the last WARPGROUP.DEPBAR within the
    innermost loop around them: each holds the sequence's later products until its load arrives, one
    L2 round trip a K step (the GEMM, its scales loaded in the step, lost 10-15% so). Loads
    issued before the loop (a tile's first scales) are once per tile and not counted.

    A linear reading, so it can miss: a load at the end of a loop body read by the next
    iteration's first wgmma sequence (the back edge is not followed), the upper registers of a
    vector load, and reads by instructions whose first operand is not their destination."""
    code = _instructions(sass)
    branches = [(int(m.group(1), 16), address) for address, op, operands in code
                if op == "BRA" and (m := re.match(r"0x([0-9a-f]+)", operands))]
    loops = [(target, address) for target, address in branches if target < address]
    fresh: dict[str, int] = {}
    inside, found = False, 0
    for address, op, operands in code:
        regs = re.findall(r"\bR\d+\b", operands)
        if op.startswith("WARPGROUP.DEPBAR"):
            fresh.clear()
            inside = False
        elif op.startswith("WARPGROUP.ARRIVE"):
            inside = True
        elif op.startswith(("QGMMA", "HGMMA")):
            inside = inside and "gsb0" not in operands
        elif op.startswith("LDG"):
            fresh[regs[0]] = address
        else:
            innermost = min(((end - start, start) for start, end in loops
                             if start <= address <= end), default=None)
            found += inside and innermost is not None and any(
                innermost[1] <= fresh[r] for r in regs[1:] if r in fresh)
            if regs and not op.startswith("ST"):
                fresh.pop(regs[0], None)  # overwritten: no longer the load's
    return found


def sass_of(workdir: Path) -> str:
    """cuobjdump's SASS of the cubin ptxas_report left."""
    tool = Path(get_ptxas(90).path).with_name("cuobjdump")
    return subprocess.run([str(tool), "-sass", str(workdir / "kernel.cubin")],
                          capture_output=True, text=True, check=True).stdout


def main() -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description="compile the Gluon kernels for sm_90")
    parser.add_argument("--only", choices=sorted(FORMS), help="one kernel's forms")
    only = parser.parse_args().only
    if g.gluon is None:
        print("this Triton has no Gluon")
        return 1
    driver.set_active(Sm90Driver())
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        for build, name in (form for kernel in ([only] if only else FORMS)
                            for form in FORMS[kernel]):
            report = ptxas_report(build(), Path(tmp))
            serialised = any("C7515" in line for line in report)
            spills = any(spill_store_bytes(line) > ENTRY_SPILL_BYTES for line in report)
            stalls = fresh_loads_in_wgmma(sass_of(Path(tmp)))
            bad |= serialised or spills or stalls > 0
            print(f"{name}: {'SERIALISED ' if serialised else ''}"
                  f"{'; '.join(line.split(': ', 1)[-1].strip() for line in report)}; "
                  f"{stalls} reads of a fresh load inside a wgmma sequence")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
