"""Shared memory, registers and spills of every Triton kernel at the release launch shapes.

    python tools/smem_check.py [--arch 89 90 120] [--skip-prefill] [--only NAME] [--check]

Compiles ahead of time (Triton's own ptxas; no GPU needed) for sm_89 (RTX 40xx), sm_90 (H100 /
H200) and sm_120 (RTX 50xx). Each launch's shared memory is printed against the architecture's
per-block limit, so a configuration only the H200 can hold shows up on a CPU machine; registers
and stack bytes per thread come from cuobjdump (a stack means spills). The numbers belong to the
installed Triton version. With --check it exits 1 when a launch could not run somewhere
(tests/kernels/test_portability.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from glmflash.kernels.fp8_gemm import triton_impl as fp8  # noqa: E402
from glmflash.kernels.fp8_gemm import triton_stream as fp8_stream  # noqa: E402
from glmflash.kernels.fused_moe import expert_rows  # noqa: E402
from glmflash.kernels.fused_moe import triton_impl as moe  # noqa: E402
from glmflash.kernels.fused_moe import triton_sort as moe_sort  # noqa: E402
from glmflash.kernels.fused_moe import triton_w8a8 as moe_w8a8  # noqa: E402
from glmflash.kernels.hyper import triton_impl as hyper  # noqa: E402
from glmflash.kernels.indexer import topk_triton as indexer_topk  # noqa: E402
from glmflash.kernels.indexer import triton_impl as indexer  # noqa: E402
from glmflash.kernels.indexer import write_triton as indexer_write  # noqa: E402
from glmflash.kernels.kda import chunk_intra as intra  # noqa: E402
from glmflash.kernels.kda import chunk_stages as stages  # noqa: E402
from glmflash.kernels.kda import chunk_walk as walk_kernels  # noqa: E402
from glmflash.kernels.kda import triton_impl as kda  # noqa: E402
from glmflash.kernels.kda import verify_triton as kda_verify  # noqa: E402
from glmflash.kernels.rms_norm import triton_impl as rms_norm  # noqa: E402
from glmflash.kernels.router import triton_impl as router  # noqa: E402
from glmflash.kernels.row_copy import triton_impl as row_copy  # noqa: E402
from glmflash.kernels.sparse_mla import combine_triton as mla_combine  # noqa: E402
from glmflash.kernels.sparse_mla import triton_impl as mla  # noqa: E402
from glmflash.kernels.swiglu import triton_impl as swiglu  # noqa: E402

# Largest dynamic shared memory one block may opt into (bytes).
BLOCK_LIMIT = {89: 101376, 90: 232448, 120: 101376}


class Launch(NamedTuple):
    name: str
    kernel: object
    pointers: dict[str, str]  # parameter -> pointer type; other non-constexpr params are i32
    constexprs: dict[str, object]
    warps: int
    stages: int | None = None
    aligned: tuple[str, ...] = ()  # int params that are multiples of 16 at release shapes
    max_registers: int | None = None  # the launch's `maxnreg`


def _divisibility(params: list[str], signature: dict[str, str], launch: Launch) -> dict:
    """What Triton's launcher specialises on at run time: 16-byte aligned pointers (torch's
    allocations) and ints that are multiples of 16 (strides, and the launch's `aligned`). The
    shared memory depends on it: aligned loads are pipelined through shared memory."""
    runtime = [p for p in params if signature[p] != "constexpr"]
    return {(i,): [["tt.divisibility", 16]] for i, p in enumerate(runtime)
            if signature[p].startswith("*") or p.startswith("stride") or p in launch.aligned}


class Usage(NamedTuple):
    shared: int  # bytes per block
    registers: int  # per thread
    stack: int  # bytes per thread: register spills live there


def usage(launch: Launch, arch: int) -> Usage:
    params = list(inspect.signature(launch.kernel.fn).parameters)
    signature = {p: "constexpr" if p in launch.constexprs else launch.pointers.get(p, "i32")
                 for p in params}
    for name in ("scale", "limit"):
        if signature.get(name) == "i32":
            signature[name] = "fp32"
    options = {"num_warps": launch.warps}
    if launch.stages is not None:
        options["num_stages"] = launch.stages
    if launch.max_registers is not None:
        options["maxnreg"] = launch.max_registers
    src = ASTSource(fn=launch.kernel, signature=signature, constexprs=launch.constexprs,
                    attrs=_divisibility(params, signature, launch))
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    registers, stack = _cubin_resources(kernel.asm["cubin"])
    return Usage(kernel.metadata.shared, registers, stack)


def _cubin_resources(cubin: bytes) -> tuple[int, int]:
    """(registers, stack bytes) per thread, from cuobjdump (shipped with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                                capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", report)
    return (int(found[1]), int(found[2])) if found else (-1, -1)


def sparse_mla_launches() -> list[Launch]:
    """Every launch shape of both regimes (64 heads x 512, bf16), and the combine kernel."""
    config = mla.DEFAULT_CONFIG
    out = [sparse_mla_launch(regime, shape)
           for regime, shapes in (("prefill", config.prefill), ("decode", config.decode))
           for shape in shapes]
    combine = {"part_o": _partial_type(), "part_lse": "*fp32", "o": "*bf16"}
    bh = config.combine_heads
    out.append(Launch("sparse_mla_combine", mla_combine.sparse_mla_combine_kernel, combine,
                      dict(BH=bh, BC=mla_combine.combine_columns(32, bh, 512, config), SP=32),
                      4, aligned=("H", "R")))
    return out


def _partial_type() -> str:
    """The pointer type of the split partials of a bf16 launch under the default config."""
    return "*bf16" if mla.DEFAULT_CONFIG.partials(torch.bfloat16) == torch.bfloat16 else "*fp32"


def sparse_mla_launch(regime: str, shape) -> Launch:
    """The attention kernel at one launch shape ("prefill": unsplit, "decode": split)."""
    split = regime == "decode"
    ptrs = {"q": "*bf16", "latent": "*bf16", "slots": "*i64", "o": "*bf16",
            "part_o": _partial_type(),
            "part_lse": "*fp32", "scale_log2": "fp32"}
    consts = dict(BH=64, BR=512, BN=shape.block_slots, TAIL_BN=shape.tail,
                  NUM_STAGES=shape.num_stages, IS_SPLIT=split, DOT=tl.bfloat16, PREC="tf32")
    name = (f"sparse_mla {regime} {shape.block_slots}/{shape.tail}/{shape.num_stages}"
            f"/{shape.num_warps}w")
    return Launch(name, mla.sparse_mla_kernel, ptrs, consts, shape.num_warps, aligned=("H", "R"))


def kda_launches(with_prefill: bool) -> list[Launch]:
    # Decode as the model runs it: the gates formed in the step from f and b (bf16).
    ptrs = dict.fromkeys(("q", "k", "v", "o", "g", "beta"), "*bf16")
    ptrs.update(state="*fp32", meta="*i32", dt_bias="*fp32", a_log="*fp32", lower_bound="fp32")
    config = kda.DEFAULT_CONFIG
    out = [Launch(f"kda decode BV{bv}", kda.kda_decode_kernel, ptrs,
                  dict(H=64, K=128, V=128, BK=128, BV=bv, GATES=True, HAS_LB=True), warps)
           for bv, warps in (config.decode_narrow, config.decode_wide)]
    walk = dict.fromkeys(("w", "u", "qg", "kd", "aqk", "o"), "*bf16")
    walk.update(gl="*fp32", state="*fp32", meta="*i32")
    out.append(Launch("kda state walk", walk_kernels.kda_chunk_state_kernel, walk,
                      dict(H=64, K=128, V=128, BK=128, BV=config.state_value_block,
                           PREC="tf32", DOT=tl.bfloat16), config.state_warps))
    if with_prefill:
        out += kda_staged_launches()
    conv = {"x": "*bf16", "weight": "*fp32", "conv_state": "*bf16", "out": "*bf16",
            "meta": "*i32"}
    out.append(Launch("causal conv1d", kda.causal_conv1d_kernel, conv,
                      dict(HIST=3, HP=4, BT=config.conv_tokens, BC=128, WRITE_STATE=True), 4,
                      aligned=("C",)))
    return out + kda_verify_launches(ptrs, conv)


def kda_verify_launches(decode_ptrs: dict, conv_ptrs: dict) -> list[Launch]:
    """The speculative verify's KDA and conv kernels (kda/verify_triton.py), keeping scratch."""
    config = kda.DEFAULT_CONFIG
    metas = {"rows": "*i32", "seqs": "*i32"}
    ptrs = {**decode_ptrs, **metas, "saved": "*fp32"}
    ptrs.pop("meta")
    out = [Launch(f"kda verify BV{bv}", kda_verify.kda_verify_kernel, ptrs,
                  dict(H=64, K=128, V=128, BK=128, BV=bv, SAVE=True, GATES=True, HAS_LB=True),
                  warps)
           for bv, warps in (config.decode_narrow, config.decode_wide)]
    conv = {**conv_ptrs, **metas, "saved": "*bf16"}
    conv.pop("meta")
    out.append(Launch("causal conv1d verify", kda_verify.conv_verify_kernel, conv,
                      dict(HIST=3, HP=4, BC=256, SAVE=True), 4, aligned=("C",)))
    return out


def kda_staged_launches() -> list[Launch]:
    """The staged prefill's kernels (chunk_stages.py) at the shapes bench/kda_sweep.py tries."""
    ptrs = dict.fromkeys(("q", "k", "v", "w", "u", "qg", "kd", "aqk", "beta"), "*bf16")
    ptrs.update(g="*fp32", g2="*fp32", rq="*fp32", rk="*fp32", gl="*fp32",
                state="*fp32", meta="*i32", tinv="*bf16", tdiag="*fp32")
    shape = dict(H=64, K=128)
    out = []
    for warps, bk in ((1, 16), (1, 32), (2, 32)):
        out.append(Launch(f"kda staged gate + intra diagonal {warps}w BK{bk}",
                          intra.kda_intra_diag_kernel, ptrs,
                          dict(shape, BK=bk, PREC="tf32", SOLVE="ieee"), warps,
                          max_registers=128))
    out.append(Launch("kda staged gate + intra diagonal 1w BK32 registers free",
                      intra.kda_intra_diag_kernel, ptrs,
                      dict(shape, BK=32, PREC="tf32", SOLVE="ieee"), 1))
    for warps, bk in ((2, 32), (4, 32)):
        out.append(Launch(f"kda staged intra off-diagonal {warps}w BK{bk}",
                          intra.kda_intra_off_kernel, ptrs,
                          dict(shape, BK=bk, PREC="tf32", SOLVE="ieee"), warps))
    for name, dot in (("bf16", tl.bfloat16), ("fp32", tl.float32)):
        wy = dict(ptrs, tinv="*bf16" if name == "bf16" else "*fp32")
        for block, warps in ((128, 8), (64, 4)):
            out.append(Launch(f"kda staged w/u T {name} {block} {warps}w", stages.kda_wy_kernel,
                              wy, dict(shape, V=128, BK=block, BV=block, DOT=dot, PREC="tf32"),
                              warps))
    return out


def fp8_launches() -> list[Launch]:
    wdq = {"x": "*bf16", "w": "*fp8e4nv", "ws": "*fp32", "y": "*bf16", "part": "*fp32",
           "arrivals": "*i32"}
    fma_n, wdq_n = fp8.DEFAULT_CONFIG.wdq_fma_block_n, fp8.DEFAULT_CONFIG.wdq_block_n
    out = [Launch(f"fp8 weight-only BM{bm} BN{bn}{' FMA' if bm == 1 else ''}"
                  f"{' fp16 codes' if codes else ''}{' of the SwiGLU' if swiglu else ''}",
                  fp8.fp8_wdq_gemm_kernel, dict(wdq, limit="fp32"),
                  dict(BLOCK=128, BM=bm, BN=bn, DOT=tl.bfloat16, PREC="tf32",
                       FMA=bm == 1, CODES=codes, SWIGLU=swiglu), fp8.DEFAULT_CONFIG.wdq_warps,
                  fp8.DEFAULT_CONFIG.wdq_stages, aligned=("N", "K", "K_PER_SPLIT"))
           for bm, bn, codes, swiglu in (
               (1, fma_n, False, False), (1, 64, False, False), (1, fma_n, False, True),
               (16, wdq_n, False, False), (16, wdq_n, True, False), (16, 128, True, False),
               (16, wdq_n, True, True), (32, wdq_n, True, False), (64, wdq_n, False, False))]
    # fp32 activations (the tiny models' GPU tests) take the weight-only kernel at every size,
    # on fp32 products in their own tile; one row may form the SwiGLU as it reads.
    fp32_rows, fp32_stages = fp8.DEFAULT_CONFIG.wdq_fp32_tile
    out += [Launch(f"fp8 weight-only fp32 BM{bm}{' FMA' if bm == 1 else ''}"
                   f"{' of the SwiGLU' if bm == 1 else ''}", fp8.fp8_wdq_gemm_kernel,
                   dict(wdq, x="*fp32", y="*fp32", limit="fp32"),
                   dict(BLOCK=128, BM=bm, BN=fma_n if bm == 1 else wdq_n, DOT=tl.float32,
                        PREC="ieee", FMA=bm == 1, CODES=False, SWIGLU=bm == 1),
                   fp8.DEFAULT_CONFIG.wdq_warps, stages, aligned=("N", "K", "K_PER_SPLIT"))
            for bm, stages in ((1, fp8.DEFAULT_CONFIG.wdq_stages), (fp32_rows, fp32_stages))]
    stream = fp8.DEFAULT_CONFIG.stream
    out += [Launch(f"fp8 stream w8a8 BN{stream.block_n} BM{bm} finish {group}",
                   fp8_stream.fp8_stream_gemm_kernel, dict(wdq, x="*bf16"),
                   dict(BLOCK=128, BN=stream.block_n, BM=bm, GROUP=group), stream.num_warps,
                   stream.num_stages, aligned=("N", "K", "K_PER_SPLIT"))
            for bm in (16, 64) for group in [stream.finish_group(stream.block_n, bm)]]
    bm, bn, warps, stages = fp8.DEFAULT_CONFIG.w8a8_tile
    w8a8 = {"xq": "*fp8e4nv", "xs": "*fp32", "w": "*fp8e4nv", "ws": "*fp32", "y": "*bf16"}
    out.append(Launch(f"fp8 w8a8 {bm}x{bn}", fp8.fp8_gemm_kernel, w8a8,
                      dict(BLOCK=128, BM=bm, BN=bn, GROUP_M=8), warps, stages,
                      aligned=("M", "N", "K")))
    return out


def fused_moe_launches() -> list[Launch]:
    """The decode and prefill shapes in bf16, and decode in fp32 (the tiny models' tests)."""
    out = [Launch("fused_moe align", moe.fused_moe_align_kernel,
                  {"ids": "*i64", "sorted_pairs": "*i32", "block_expert": "*i32"},
                  dict(BLOCK_M=16, BLOCK=moe.ALIGN_BLOCK, BINS=512), 4)]
    sort = moe_sort.SORT_CONFIG
    sort_ptrs = {"ids": "*i64", "counts": "*i32", "offsets": "*i32", "sorted_pairs": "*i32",
                 "block_expert": "*i32"}
    out += [Launch("fused_moe sort count", moe_sort.moe_count_kernel, sort_ptrs,
                   dict(CHUNK=sort.chunk, BINS=512), sort.num_warps),
            Launch("fused_moe sort scatter", moe_sort.moe_scatter_kernel, sort_ptrs,
                   dict(BLOCK_M=64, CHUNK=sort.chunk, SUB=sort.sub, BINS=512,
                        BB=sort.block_rows), sort.num_warps)]
    codes = dataclasses.replace(moe.DECODE_CONFIG, fp16_codes=True)
    for cfg, dtype in ((moe.DECODE_CONFIG, "bf16"), (codes, "bf16"), (moe.PREFILL_CONFIG, "bf16"),
                       (moe.FP32_CONFIG, "fp32")):
        dot, prec = (tl.float32, "ieee") if dtype == "fp32" else (tl.bfloat16, "tf32")
        consts = dict(BLOCK=128, HAS_SCALE=True, BM=cfg.block_m, BN=cfg.block_n,
                      BK=cfg.block_k, DOT=dot, PREC=prec, CODES=cfg.fp16_codes)
        rows = {"sorted_pairs": "*i32", "block_expert": "*i32"}
        gate_up = dict(rows, x=f"*{dtype}", w_gate="*fp8e4nv", s_gate="*fp32", w_up="*fp8e4nv",
                       s_up="*fp32", h=f"*{dtype}")
        down = dict(rows, h=f"*{dtype}", w="*fp8e4nv", s="*fp32", y=f"*{dtype}")
        name = f"fused_moe {dtype} BM{cfg.block_m} BN{cfg.block_n}" + \
            (" fp16 codes" if cfg.fp16_codes else "")
        out += [Launch(f"{name} gate/up", moe.fused_moe_gate_up_kernel, gate_up,
                       dict(consts, TOP_K=8), cfg.num_warps, cfg.num_stages, aligned=("N", "K")),
                Launch(f"{name} down", moe.fused_moe_down_kernel, down, consts, cfg.num_warps,
                       cfg.num_stages, aligned=("N", "K"))]
    cfg = moe_w8a8.W8A8_CONFIG
    rows = {"sorted_pairs": "*i32", "block_expert": "*i32", "xs": "*fp32", "hs": "*fp32"}
    consts = dict(BLOCK=128, BM=cfg.block_m, BK=cfg.block_k, GROUP_M=cfg.group_m)
    gate_up = dict(rows, xq="*fp8e4nv", w_gate="*fp8e4nv", s_gate="*fp32", w_up="*fp8e4nv",
                   s_up="*fp32", hq="*fp8e4nv")
    down = dict(rows, hq="*fp8e4nv", w="*fp8e4nv", s="*fp32", y="*bf16")
    out += [Launch(f"fused_moe w8a8 BM{cfg.block_m} gate/up",
                   moe_w8a8.fused_moe_w8a8_gate_up_kernel, gate_up, dict(consts, TOP_K=8),
                   cfg.gate_up_warps, cfg.gate_up_stages, aligned=("N", "K")),
            Launch(f"fused_moe w8a8 BM{cfg.block_m} down", moe_w8a8.fused_moe_w8a8_down_kernel,
                   down, consts, cfg.down_warps, cfg.down_stages, aligned=("N", "K"))]
    out.append(Launch("fused_moe sum", expert_rows.fused_moe_sum_kernel,
                      {"y": "*bf16", "ids": "*i64", "weights": "*fp32", "out": "*bf16"},
                      dict(TOP_K=8, BD=expert_rows.SUM_BLOCK), 4, aligned=("D",)))
    return out


def indexer_launches() -> list[Launch]:
    """Scoring and the radix top-k (every pass) at their default launch shapes; the decode
    write, the MoE router and the state row copy."""
    ptrs = {"q": "*bf16", "weights": "*bf16", "pool_keys": "*bf16", "page_table": "*i32",
            "rows": "*i64", "positions": "*i64", "num_pools": "*i64", "scores": "*fp32",
            "lengths": "*i32", "w_scale": "fp32"}
    one, chunk = indexer.ONE_QUERY, indexer.CHUNK_SCORE
    out = []
    forms = (("", False, indexer.Q_AS_IS, tl.bfloat16),
             (", FP8 keys", True, indexer.Q_POW2, tl.float16),
             (", FP8 keys and queries", True, indexer.Q_FP8, tl.float8e4nv))
    for keys, fp8_keys, q_form, dot in forms:
        key_ptrs = dict(ptrs, pool_keys="*u8") if fp8_keys else ptrs
        score = dict(KPOOL=4, PAGE=64, BHQ=32, BD=128, PREC="tf32", FP8_KEYS=fp8_keys,
                     DOT=dot, Q_FORM=q_form)
        out += [Launch(f"indexer score{keys}", indexer.indexer_score_kernel, key_ptrs,
                       dict(score, BP=one.block_pools), 4,
                       aligned=("NH", "D"))]
        out += [Launch(f"indexer score {tiled.queries} queries x {tiled.pool_blocks} blocks"
                       f"{keys}", indexer.indexer_score_tiled_kernel, key_ptrs,
                       dict(score, BP=tiled.block_pools, BQ=tiled.queries,
                            POOL_BLOCKS=tiled.pool_blocks, NUM_STAGES=tiled.num_stages),
                       tiled.num_warps, tiled.num_stages, aligned=("NH", "D"))
                for tiled in (chunk, *indexer.DECODE_SCORE.tiled)]
    topk = {"scores": "*fp32", "lengths": "*i32", "hist": "*i32", "seg_hist": "*i32",
            "above": "*i32", "cand": "*i32", "num_cand": "*i32", "out": "*i32"}
    config = indexer_topk.DEFAULT_CONFIG
    consts = dict(BLOCK=config.block)
    out += [Launch(f"indexer top-k byte {p} ({warps} warps)", indexer_topk.topk_byte_kernel,
                   topk, dict(consts, PASS=p, LIST_DIVISOR=config.list_divisor), warps)
            for warps in (config.num_warps, config.few_programs_warps) for p in range(4)]
    out += [Launch(f"indexer top-k write ({warps} warps)", indexer_topk.topk_write_kernel, topk,
                   consts, warps) for warps in (config.num_warps, config.few_programs_warps)]
    write = {"keys": "*bf16", "gates": "*bf16", "ape": "*bf16", "pool_keys": "*bf16",
             "tail": "*bf16", "page_table": "*i32", "slots": "*i64", "positions": "*i64"}
    for keys, fp8_keys in (("", False), (", FP8 keys", True)):
        key_write = dict(write, pool_keys="*u8") if fp8_keys else write
        out.append(Launch(f"indexer write decode{keys}", indexer_write.indexer_write_decode_kernel,
                          key_write, dict(KPOOL=4, KP=4, PAGE=64, BD=128, FP8_KEYS=fp8_keys), 1,
                          aligned=("D",)))
        out.append(Launch(f"indexer write verify{keys}", indexer_write.indexer_write_verify_kernel,
                          {**key_write, "saved": "*bf16", "seqs": "*i32"},
                          dict(KPOOL=4, KP=4, PAGE=64, BD=128, BTAIL=1024, SAVE=True,
                               FP8_KEYS=fp8_keys), 1, aligned=("D",)))
    select = {"scores": "*fp32", "bias": "*fp32", "ids": "*i64", "weights": "*fp32",
              "scaling": "fp32"}
    choice = dict(G=1, GP=1, EGP=512, TOPK_GROUPS=1, TOPK=8, KP=8, RENORM=True)
    scores = {"x": "*bf16", "w": "*bf16", "arrivals": "*i32", **select}
    for tokens in (1, 64):
        cfg = router.default_score_config(tokens)
        out.append(Launch(f"router scores BT{cfg.block_t} with the choice",
                          router.router_scores_kernel, scores,
                          dict(BT=cfg.block_t, BE=cfg.block_e, BK=cfg.block_k, SELECT=True,
                               **choice), cfg.num_warps, aligned=("K",)))
    out.append(Launch("router select", router.router_select_kernel, select, choice, 4))
    out.append(Launch("rms_norm pair (MLA latents)", rms_norm.rms_norm_pair_kernel,
                      dict.fromkeys(("x", "weight_a", "weight_b", "out_a", "out_b"), "*bf16")
                      | {"rows_b": "*i64", "eps_a": "fp32", "eps_b": "fp32"},
                      dict(BA=2048, BB=512), 4, aligned=("A", "B", "stride_x")))
    out.append(Launch("swiglu", swiglu.swiglu_kernel, {"gate_up": "*bf16", "out": "*bf16",
                                                        "limit": "fp32"},
                      dict(BLOCK=swiglu.BLOCK), 4, aligned=("width", "stride_in", "stride_out")))
    copy = {"src": "*fp32", "src_rows": "*i64", "dst": "*fp32", "dst_rows": "*i64"}
    out.append(Launch("row copy", row_copy.copy_rows_kernel, copy,
                      dict(BLOCK=row_copy.DEFAULT_BLOCK), 4))
    return out


def hyper_launches() -> list[Launch]:
    """mHC pre at the default shapes of decode (1 and 64 tokens) and prefill (2048 and 8192 on
    the H200's 132 SMs), and mHC post; S = 4, D = 4096, bf16."""
    pre = {"x": "*bf16", "fn": "*bf16", "base": "*fp32", "scale": "*fp32", "post": "*fp32",
           "comb": "*fp32", "out": "*bf16", "part": "*fp32", "arrivals": "*i32",
           "norm_w": "*bf16", "norm_eps": "fp32", "hc_eps": "fp32", "rms_eps": "fp32"}
    out = []
    # bf16 at the release shapes; fp32 (the tiny models' GPU tests) at a decode and a prefill.
    cases = [(tokens, "bf16") for tokens in (1, 64, 2048, 8192)] + [(1, "fp32"), (2048, "fp32")]
    for tokens, dtype in cases:
        fp32 = dtype == "fp32"
        cfg = hyper.default_pre_config(tokens, 4, 132, fp32_products=fp32)
        dot = cfg.block_t >= 16
        consts = dict(S=4, ITERS=20, NP=32, BT=cfg.block_t, BK=cfg.block_k, BD=cfg.block_d,
                      USE_DOT=dot, USE_SPLIT=True, RB=hyper.range_block(64, cfg.block_t, 32),
                      DOT=tl.float32 if fp32 else tl.bfloat16, PREC="ieee" if fp32 else "tf32",
                      PREFETCH=cfg.prefetch_streams, NORM=True)
        ptrs = pre | (dict.fromkeys(("x", "fn", "out", "norm_w"), "*fp32") if fp32 else {})
        out.append(Launch(f"hyper_pre BT{cfg.block_t} {'dot' if dot else 'FMA'}"
                          f"{' fp32' if fp32 else ''}", hyper.hyper_pre_kernel, ptrs, consts,
                          cfg.num_warps, aligned=("D", "stride_fn", "K_PER_SPLIT")))
    post = {"y": "*bf16", "y2": "*bf16", "x": "*bf16", "post": "*fp32", "comb": "*fp32",
            "out": "*bf16", "ids": "*i64", "weights": "*fp32"}
    for tokens, top_k in ((1, 0), (1, 8), (2048, 0)):
        cfg = hyper.default_post_config(tokens)
        rows = " summing 8 routed rows" if top_k else ""
        out.append(Launch(f"hyper_post BD{cfg.block_d}{rows}", hyper.hyper_post_kernel, post,
                          dict(S=4, BD=cfg.block_d, TWO=True, TOP_K=top_k), cfg.num_warps,
                          aligned=("D", "stride_y", "stride_y2")))
    return out


def problems(used: dict[str, dict[int, int]]) -> list[str]:
    """Launches that no GPU of an architecture could run: any kernel over the limit, except that
    sparse MLA only needs one fitting configuration per regime (its launcher falls back)."""
    found, regimes = [], {}
    for name, per_arch in used.items():
        for arch, size in per_arch.items():
            fits = size <= BLOCK_LIMIT[arch]
            if name.startswith("sparse_mla "):
                regimes.setdefault((name.split()[1], arch), []).append(fits)
            elif not fits:
                found.append(f"{name} needs {size} bytes on sm_{arch}")
    found += [f"no sparse_mla {regime} configuration fits sm_{arch}"
              for (regime, arch), fits in regimes.items() if not any(fits)]
    return found


def _cell(u: Usage, arch: int) -> str:
    """Shared KB (flagged when over the block limit) / registers / spill bytes."""
    too_big = "" if u.shared <= BLOCK_LIMIT[arch] else " **too big**"
    return f"{u.shared / 1024:.0f}{too_big} / {u.registers} / {u.stack}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[89, 90, 120])
    parser.add_argument("--skip-prefill", action="store_true",
                        help="skip the KDA prefill's stages (their compiles take minutes)")
    parser.add_argument("--only", default=None,
                        help="compile only the launches whose name starts with this")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a launch cannot run on one of the architectures")
    args = parser.parse_args()
    launches = (sparse_mla_launches() + kda_launches(not args.skip_prefill) + fp8_launches()
                + fused_moe_launches() + indexer_launches() + hyper_launches())
    launches = [launch for launch in launches if launch.name.startswith(args.only or "")]
    print(f"Triton {triton.__version__}; per launch: KB of shared memory per block (limit in the "
          "header) / registers per thread / stack bytes per thread (spills)")
    print("| kernel | " + " | ".join(f"sm_{a} (<= {BLOCK_LIMIT[a] // 1024})" for a in args.arch)
          + " |")
    print("|---|" + "---|" * len(args.arch))
    used: dict[str, dict[int, int]] = {}
    for launch in launches:
        per_arch = {arch: usage(launch, arch) for arch in args.arch}
        used[launch.name] = {arch: u.shared for arch, u in per_arch.items()}
        cells = [_cell(u, arch) for arch, u in per_arch.items()]
        print(f"| {launch.name} | " + " | ".join(cells) + " |", flush=True)
    found = problems(used)
    for line in found:
        print(f"PROBLEM: {line}")
    if args.check and found:
        sys.exit(1)


if __name__ == "__main__":
    main()
