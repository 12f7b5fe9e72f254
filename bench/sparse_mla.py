"""Sparse MLA rows of bench/kernels.py: decode at 1, 8 and 32 queries and a prefill of 4096, each
with a few launch configurations, against the roofline max(bytes / HBM copy, FLOPs / bf16 peak).

    PYTHONPATH=. python bench/kernels.py --ops mla --out /tmp/mla.md

Release shapes: 64 heads, a 512-wide bf16 latent, 2051 selected slots per query out of a
128K-token cache per sequence (decode rows: one sequence per query; prefill: 4096 queries of
one sequence). Decode rows rotate slot sets so that replays gather from HBM, not L2.
"""

from __future__ import annotations

import dataclasses

import torch

from bench.common import bench_ms, copies, graph_ms, rel, table

HEADS, RANK, WIDTH, CONTEXT = 64, 512, 2051, 131072
DECODE_QUERIES = (1, 8, 32)
PREFILL_QUERIES = 4096


def sweep_configs(queries: int) -> dict[str, object]:
    """The default launch configuration and the variations that the row can decide."""
    from glmflash.kernels.sparse_mla.plan import DEFAULT_CONFIG, SparseMlaLaunch, split_plan
    from glmflash.kernels.triton_utils import num_sms

    def shapes(*launches):
        return dataclasses.replace(DEFAULT_CONFIG, prefill=launches, decode=launches)

    configs = {"default": DEFAULT_CONFIG}
    sms = num_sms(torch.device("cuda"))
    splits = split_plan(queries, HEADS, WIDTH, 64, sms, DEFAULT_CONFIG).num_splits
    if splits == 1:
        configs["32-slot steps"] = shapes(SparseMlaLaunch(32, 2, tail_slots=16))
        configs["2 stages"] = shapes(SparseMlaLaunch(64, 2, tail_slots=16))
        return configs
    configs["64-slot tail steps"] = shapes(SparseMlaLaunch(64, 2))
    configs["fp32 partials"] = dataclasses.replace(DEFAULT_CONFIG, partial_dtype=torch.float32)
    return configs


def mla_inputs(queries: int):
    seqs = queries if queries <= 32 else 1
    latent = torch.randn(seqs * CONTEXT, RANK, device="cuda").bfloat16()
    q = torch.randn(queries, HEADS, RANK, device="cuda").bfloat16()
    owner = (torch.arange(queries, device="cuda") % seqs)[:, None] * CONTEXT
    distinct = torch.stack([torch.randperm(CONTEXT, device="cuda")[:WIDTH]
                            for _ in range(min(queries, 64))])
    slots = distinct.repeat(-(-queries // distinct.shape[0]), 1)[:queries] + owner
    return q, latent, slots, owner


def rotated_slots(slots: torch.Tensor, owner: torch.Tensor, moved: int) -> list[torch.Tensor]:
    """Decode: `slots` and other slot sets over the same caches, so that each call gathers rows
    no recent call touched. Prefill (more queries than sequences): `slots` alone."""
    if slots.shape[0] > DECODE_QUERIES[-1]:
        return [slots]
    return [slots] + [torch.randint(0, CONTEXT, slots.shape, device="cuda") + owner
                      for _ in range(copies(moved) - 1)]


def roofline(queries: int, q: torch.Tensor, slots: torch.Tensor, copy_gbs: float,
             peak_tflops: float) -> tuple[int, float]:
    """(bytes moved, roofline ms): max(bytes / copy bandwidth, FLOPs / bf16 peak); bytes are
    the gathered latent rows, q in and out, and the slot indices."""
    moved = queries * WIDTH * RANK * 2 + 2 * q.numel() * 2 + slots.numel() * 8
    flops = 4 * queries * HEADS * WIDTH * RANK
    return moved, max(moved / copy_gbs / 1e6, flops / peak_tflops / 1e9)


def bench_sparse_mla(copy_gbs: float, peak_tflops: float) -> str:
    rows = []
    for queries in DECODE_QUERIES + (PREFILL_QUERIES,):
        rows += _rows(queries, copy_gbs, peak_tflops)
    return table(["queries", "config", "launch", "us (graph)", "GB/s",
                  "% of copy", "TFLOP/s", "roofline us", "% of roofline", "torch ref us",
                  "rel err vs fp32 ref"], rows)


def _rows(queries: int, copy_gbs: float, peak_tflops: float) -> list[list]:
    from glmflash.kernels.sparse_mla import sparse_mla_ref

    q, latent, slots, owner = mla_inputs(queries)
    moved, roofline_ms = roofline(queries, q, slots, copy_gbs, peak_tflops)
    flops = 4 * queries * HEADS * WIDTH * RANK
    slot_sets = rotated_slots(slots, owner, moved)
    want = sparse_mla_ref(q.float(), latent.float(), slots, scale=1 / 16)
    ref_ms = bench_ms(lambda: sparse_mla_ref(q, latent, slots, scale=1 / 16),
                      rep=50 if queries <= 32 else 5)
    rows = []
    for name, config in sweep_configs(queries).items():
        ms, err, how = time_config(q, latent, slot_sets, want, config)
        gbs = moved / ms / 1e6 if ms else 0.0
        rows.append([queries, name, how, f"{ms * 1e3:.1f}", f"{gbs:.0f}",
                     f"{100 * gbs / copy_gbs:.0f}%", f"{flops / ms / 1e9:.0f}" if ms else "-",
                     f"{roofline_ms * 1e3:.1f}", f"{100 * roofline_ms / ms:.0f}%" if ms else "-",
                     f"{ref_ms * 1e3:.0f}", err])
        print(rows[-1], flush=True)
    return rows


def _is_gluon(config) -> bool:
    from glmflash.kernels.sparse_mla.gluon_sm90 import GluonSparseMlaConfig

    return isinstance(config, GluonSparseMlaConfig)


def run_config(q, latent, slots, config, workspace):
    """One call of the kernel that `config` configures (the Triton or the Gluon form)."""
    from glmflash.kernels.sparse_mla import gluon_sm90
    from glmflash.kernels.sparse_mla import triton_impl as ti

    impl = gluon_sm90 if _is_gluon(config) else ti
    return impl.sparse_mla(q, latent, slots, scale=1 / 16, config=config, workspace=workspace)


def make_workspace(q, config):
    from glmflash.kernels.sparse_mla.plan import SparseMlaWorkspace
    from glmflash.kernels.triton_utils import num_sms

    split = config.split_config() if _is_gluon(config) else config
    return SparseMlaWorkspace.create(q.shape[0], HEADS, RANK, WIDTH, q.device,
                                     num_sms(q.device), split, q.dtype)


def launch_split(q, slots, config, workspace):
    """(splits of the launch of `config`, the configuration of its combine launch, the
    launch's steps in words)."""
    from glmflash.kernels.sparse_mla import gluon_sm90
    from glmflash.kernels.sparse_mla import triton_impl as ti

    if _is_gluon(config):
        plan = gluon_sm90.plan_for(q, slots, config, workspace)
        return (plan.num_splits, config.combine,
                f"Gluon, {config.block_slots}-slot steps, {config.stages} stages")
    shape, plan = ti.launch_plan(q, slots, config, workspace)
    return (plan.num_splits, config,
            f"{shape.block_slots}/{shape.tail}-slot steps, {shape.num_stages} stages")


def describe(q, slots, config, workspace) -> str:
    """How the launch of `config` splits, in words."""
    splits, _, steps = launch_split(q, slots, config, workspace)
    partials = str(workspace.partial_out.dtype).removeprefix("torch.")
    return f"{steps}, " + ("unsplit" if splits == 1 else
                           f"{splits} splits x {q.shape[0] * -(-HEADS // 64)} head blocks, "
                           f"{partials} partials")


def time_config(q, latent, slot_sets, want, config) -> tuple[float, str, str]:
    """(ms per call replayed from a CUDA graph, relative error, how the launch split)."""
    workspace = make_workspace(q, config)
    try:
        err = rel(run_config(q, latent, slot_sets[0], config, workspace).float(), want)
        ms = graph_ms([lambda s=s: run_config(q, latent, s, config, workspace)
                       for s in slot_sets])
    except Exception as e:  # noqa: BLE001 - a configuration that does not run is a result too
        return 0.0, type(e).__name__, "-"
    return ms, f"{err:.1e}", describe(q, slot_sets[0], config, workspace)
