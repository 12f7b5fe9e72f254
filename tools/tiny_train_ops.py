"""The reference ops batched across sequences, for training the tiny model.

The model's own code runs under autograd with the pure-PyTorch references (Triton kernels have no
backward). The references loop over the sequences of a batch (KDA's chunked form, the indexer's
selection) and the routed experts loop over the experts hit with host syncs; with hundreds of
short sequences per step that is thousands of small launches. A training step has only fresh
sequences (nothing cached before), so the same maths can run on all sequences at once, padded to
the longest: `training_ops()` installs these batched forms for the duration of a run.
tests/tiny/test_train_ops.py checks each against its reference.

* `conv_fresh`: KDA's short causal convolution on the padded layout (no host sync);
* `kda_fresh`: the chunked gated delta rule of `kda_ref` on `[L, B*H, d]` (padding rows are zero
  with no decay and beta 0, so they change neither outputs nor states);
* `select_fresh`: `indexer_select_ref`'s top-k pools plus tail, scored for all queries at once
  (no gradient: the selection is integer);
* `DenseExperts`: the routed experts' weighted sum computed for every expert on every token with
  zero weight where not routed (the same sum, no host sync), counting the routing choices.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

import glmflash.kernels.kda.ref as kda_ref_module
import glmflash.kernels.sparse_mla.ref as sparse_mla_ref_module
import glmflash.model.glm as glm_module
import glmflash.model.indexer as indexer_module
import glmflash.model.kda as kda_module
from glmflash.kernels.hyper.ref import hyper_post_ref, hyper_pre_ref
from glmflash.kernels.indexer.ref import SelectPlan, token_slots
from glmflash.kernels.kda.ref import causal_conv1d_ref, chunked_sequence, kda_ref, l2_normalize
from glmflash.kernels.rms_norm import rms_norm_ref
from glmflash.model.layers import clamped_swiglu
from glmflash.model.moe import Experts
from glmflash.utils.device import upload

# Every op the model dispatches: the reference on every device (autograd needs it).
REF_OPS = ("KDA", "CAUSAL_CONV1D", "KDA_GATES", "INDEXER", "INDEXER_SELECT", "SPARSE_MLA",
           "HYPER", "RMS_NORM", "SWIGLU", "FP8_GEMM", "FUSED_MOE", "ROUTER")
# Queries per block of the sparse MLA reference while training (its memory is small here).
TRAIN_QUERY_BLOCK = 1 << 15


class Padded:
    """Where each packed token of a varlen batch sits in a `[B, L]` padded layout."""

    def __init__(self, cu_seqlens: list[int], device: torch.device, multiple: int = 1) -> None:
        lens = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
        self.num_seqs, self.num_tokens = len(lens), int(cu_seqlens[-1])
        self.length = int(-(-lens.max() // multiple) * multiple)
        seq = np.repeat(np.arange(self.num_seqs), lens)
        pos = np.arange(self.num_tokens) - np.asarray(cu_seqlens[:-1])[seq]
        flat = seq * self.length + pos  # packed row -> padded cell
        starts = np.asarray(cu_seqlens[:-1], dtype=np.int64)
        self.flat, self.starts = upload(np.concatenate([flat, starts]), device).split(
            [self.num_tokens, self.num_seqs])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> `[B, L, ...]`, zeros after each sequence (differentiable). A copy to
        distinct rows: its gradient is a gather (a gather from a shared zero row would have a
        scatter with many duplicate rows, slow on a GPU)."""
        cells = x.new_zeros(self.num_seqs * self.length, *x.shape[1:])
        return cells.index_copy(0, self.flat, x).view(self.num_seqs, self.length, *x.shape[1:])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """`[B, L, ...]` -> `[T, ...]` (gradient: an atomic scatter-add)."""
        return x.reshape(self.num_seqs * self.length, *x.shape[2:]).index_select(0, self.flat)


def padded_layout(batch, device: torch.device, multiple: int = 1) -> Padded:
    """The layout of a ForwardBatch's sequences, built once per forward."""
    return batch.cached(f"padded{multiple}", lambda: Padded(batch.cu_seqlens, device, multiple))


def kda_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor, cu_seqlens: list[int],
              state_slots: list[int], is_fresh: list[bool], *, chunk_size: int = 64,
              layout: Padded | None = None) -> torch.Tensor:
    """`kda_ref` for batches of fresh sequences (others go to `kda_ref`); the final states are
    written detached (training never reads them)."""
    if not all(is_fresh) or len(cu_seqlens) < 3:
        return kda_ref(q, k, v, g, beta, state, cu_seqlens, state_slots, is_fresh,
                       chunk_size=chunk_size)
    layout = layout or Padded(cu_seqlens, q.device, chunk_size)
    out_dtype, (num_tokens, heads, _) = q.dtype, q.shape
    q = l2_normalize(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = l2_normalize(k.float()), v.float(), g.float(), beta.float()
    batch, length = layout.num_seqs, layout.length

    def lbh(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [L, B*H, ...]
        x = layout.pad(x).transpose(0, 1)
        return x.reshape(length, batch * heads, *x.shape[3:])

    s0 = q.new_zeros(batch * heads, k.shape[-1], v.shape[-1])
    out, s = chunked_sequence(lbh(q), lbh(k), lbh(v), lbh(g), lbh(beta), s0, chunk_size)
    slots = upload(state_slots, q.device)
    state[slots] = s.detach().view(batch, heads, *s.shape[1:]).to(state.dtype)
    out = out.reshape(length, batch, heads, -1).transpose(0, 1)
    return layout.unpad(out).to(out_dtype).view(num_tokens, heads, -1)


def conv_fresh(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
               cu_seqlens: list[int], state_slots: list[int], is_fresh: list[bool]
               ) -> torch.Tensor:
    """`causal_conv1d_ref` for batches of fresh sequences (others go to the reference): the
    window sums on the padded `[B, K-1+L, C]` layout, whose index tensors reach the device
    without a host sync; the last K-1 inputs of each sequence are written detached."""
    if not all(is_fresh):
        return causal_conv1d_ref(x, weight, conv_state, cu_seqlens, state_slots, is_fresh)
    layout = Padded(cu_seqlens, x.device)
    hist_len = weight.shape[-1] - 1
    padded = nn.functional.pad(layout.pad(x), (0, 0, hist_len, 0))  # [B, K-1+L, C]
    w = weight.float().t()  # [K, C]
    out = sum(padded[:, k: k + layout.length].float() * w[k] for k in range(hist_len + 1))
    lens = upload(np.diff(cu_seqlens), x.device)
    keep = lens[:, None] + torch.arange(hist_len, device=x.device)  # [B, K-1] rows of padded
    last = padded.gather(1, keep[..., None].expand(-1, -1, padded.shape[-1]))
    conv_state[upload(state_slots, x.device)] = last.detach().transpose(1, 2).to(
        conv_state.dtype)
    return nn.functional.silu(layout.unpad(out)).to(x.dtype)


def select_fresh(q: torch.Tensor, weights: torch.Tensor, pool_keys: torch.Tensor,
                 page_table: torch.Tensor, plan: SelectPlan, *, page_size: int, topk: int,
                 kpool: int, select_tail: bool, tiling=None,
                 layout: Padded | None = None, weight_scale: float = 1.0,
                 fp8_queries: bool = False) -> torch.Tensor:
    """`indexer_select_ref` for one forward of fresh sequences (`layout` set), all queries
    scored at once: the best `topk / kpool` complete pools before each query, then its tail.
    Training keeps the pooled keys in the model dtype, so `fp8_queries` must be False."""
    if fp8_queries:
        raise ValueError("training scores model-dtype keys: fp8_queries is not supported")
    with torch.no_grad():
        b_rows = plan.rows[layout.starts]  # page-table row of each sequence [B]
        num_pools = layout.length // kpool
        ordinal = torch.arange(num_pools, device=q.device)
        first = token_slots(page_table, b_rows[:, None], ordinal * kpool, page_size)  # [B, P]
        keys = pool_keys[first // kpool].float()  # [B, P, D]
        qp = layout.pad(q.float())  # [B, L, H, D]
        scores = torch.relu(torch.einsum("blhd,bpd->blhp", qp, keys) * q.shape[-1] ** -0.5)
        scores = torch.einsum("blh,blhp->blp", layout.pad(weights.float() * weight_scale),
                              scores)
        scores = layout.unpad(scores)  # [T, P]
        positions = plan.positions
        candidate = ((ordinal + 1) * kpool - 1)[None, :] <= positions[:, None]
        candidate &= ordinal[None, :] < plan.num_pools[:, None]
        scores = scores.masked_fill(~candidate, torch.finfo(scores.dtype).min)
        best = scores.topk(min(topk // kpool, num_pools), dim=1)
        pools = torch.where(candidate.gather(1, best.indices), best.indices, -1)
        return _expand(pools, plan.rows, positions, page_table, page_size, kpool, select_tail,
                       topk + (kpool - 1 if select_tail else 0))


def _expand(pools: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
            page_table: torch.Tensor, page_size: int, kpool: int, select_tail: bool,
            width: int) -> torch.Tensor:
    """Pool ordinals `[T, k]` -> token slots `[T, width]` (their tokens, then the query's own
    incomplete pool), -1 padded."""
    offsets = torch.arange(kpool, device=pools.device)
    token_pos = (pools[..., None] * kpool + offsets).flatten(1)
    token_pos = token_pos.masked_fill((pools < 0).repeat_interleave(kpool, dim=1), -1)
    if select_tail:
        visible = positions + 1
        tail = (visible - visible % kpool)[:, None] + offsets[: kpool - 1]
        token_pos = torch.cat([token_pos, tail.masked_fill(tail >= visible[:, None], -1)], dim=1)
    slots = token_slots(page_table, rows[:, None], token_pos.clamp(min=0), page_size)
    slots = torch.where(token_pos >= 0, slots, -1)
    return nn.functional.pad(slots, (0, width - slots.shape[1]), value=-1)


class DenseExperts:
    """A training backend of `Experts` (its `backend` hook): every expert on every token, the
    outputs weighted by a `[T, E]` matrix holding the routing weights (zero where not routed);
    the routing choices are counted into `counts` on the device."""

    def __init__(self, experts: Experts) -> None:
        self.experts = experts
        self.counts = torch.zeros(experts.gate_proj.weight.shape[0], device=
                                  experts.gate_proj.weight.device)
        self.counted: torch.Tensor | None = None
        """`[T]` 1 for the tokens whose choices count (0: padding); None: all count."""

    def start(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ones = torch.ones_like(ids, dtype=self.counts.dtype)
        if self.counted is not None:
            ones = ones * self.counted[:, None]
        self.counts.index_add_(0, ids.flatten(), ones.flatten())
        gate, up, down = (p.weight for p in self.experts.projections())
        return _OPS["dense_experts"](x, ids, weights, gate, up, down, self.experts.limit)

    def finish(self, pending: torch.Tensor) -> torch.Tensor:
        return pending


def count_only(module: nn.Module, counted: torch.Tensor | None) -> None:
    """Count the routing choices of `module`'s experts on the tokens marked in `counted`."""
    for m in module.modules():
        if isinstance(m, Experts) and isinstance(m.backend, DenseExperts):
            m.backend.counted = counted


def dense_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                  limit: float) -> torch.Tensor:
    """`fused_moe_ref` of plain weights `[E, N, K]` as dense products over all experts."""
    dense = x.new_zeros(x.shape[0], gate.shape[0]).scatter(1, ids, weights.to(x.dtype))
    act = clamped_swiglu(torch.einsum("td,eid->eti", x, gate),
                         torch.einsum("td,eid->eti", x, up), limit)
    return torch.einsum("eti,edi->td", act * dense.t()[..., None], down)


_OPS = {"dense_experts": dense_experts}


def _kda_in_forward(q, k, v, g, beta, state, cu_seqlens, state_slots, is_fresh, **kwargs):
    return kda_fresh(q, k, v, g, beta, state, cu_seqlens, state_slots, is_fresh, **kwargs)


def _select_in_forward(q, weights, pool_keys, page_table, plan, **kwargs):
    """`indexer_select` of a training forward: its plan has one group per sequence (each
    longer than one token), in order."""
    lens = [int(group.idx.numel()) for group in plan.groups]
    if sum(lens) != q.shape[0] or not all(group.shared for group in plan.groups):
        raise ValueError("training batches hold fresh sequences of at least two tokens")
    layout = Padded(np.cumsum([0, *lens]).tolist(), q.device)
    return select_fresh(q, weights, pool_keys, page_table, plan, layout=layout, **kwargs)


def decayed_products_elementwise(q: torch.Tensor, k: torch.Tensor, decay: torch.Tensor
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`kda_ref`'s decayed key products as broadcast products and sums: the reference's
    three-operand einsums run as millions of one-element matrix products, slow on a GPU (and
    slower still in their backward)."""
    return ((k.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1),
            (q.unsqueeze(2) * k.unsqueeze(1) * decay).sum(-1))


def _compiled_ops() -> dict[str, tuple[object, str, object]]:
    """(module, name, compiled function) of the blocks `torch.compile` may fuse: mHC with its
    Sinkhorn iterations, the dense experts, one KDA chunk (shapes vary: dynamic)."""
    compile_ = lambda f: torch.compile(f, dynamic=True)  # noqa: E731
    return {"hyper_pre": (glm_module, "hyper_pre", _pre_with_norm(compile_(hyper_pre_ref))),
            "hyper_post": (glm_module, "hyper_post",
                           _post_with_extra(compile_(hyper_post_ref))),
            "kda_chunk": (kda_ref_module, "_chunk", compile_(kda_ref_module._chunk))}


def _pre_with_norm(pre_ref):
    """`hyper_pre`'s signature over a (compiled) `hyper_pre_ref`: the input norm after it."""
    def pre(streams, fn, base, scale, *, norm=None, **kwargs):
        post, comb, collapsed = pre_ref(streams, fn, base, scale, **kwargs)
        return post, comb, collapsed if norm is None else rms_norm_ref(collapsed, *norm)
    return pre


def _post_with_extra(post_ref):
    """`hyper_post`'s signature over a (compiled) `hyper_post_ref`: `extra` added first."""
    def post(block_out, streams, post_weights, comb, *, extra=None):
        out = block_out if extra is None else block_out + extra
        return post_ref(out, streams, post_weights, comb)
    return post


@contextlib.contextmanager
def training_ops(*modules: nn.Module, compile: bool = False) -> Iterator[list[DenseExperts]]:
    """Install the batched forms (and the references on every device) while training `modules`;
    yields the experts' training backends (their routing counts). `compile`: also
    `torch.compile` the blocks of `_compiled_ops`."""
    saved_env = {op: os.environ.get(f"GLMFLASH_KERNEL_{op}") for op in REF_OPS}
    saved = (kda_module.kda, kda_module.causal_conv1d, indexer_module.indexer_select,
             sparse_mla_ref_module.QUERY_BLOCK, kda_ref_module._decayed_products)
    compiled = _compiled_ops() if compile else {}
    saved_compiled = [(module, name, getattr(module, name))
                      for module, name, _ in compiled.values()]
    experts = [m for module in modules for m in module.modules() if isinstance(m, Experts)]
    backends = [DenseExperts(e) for e in experts]
    try:
        os.environ.update({f"GLMFLASH_KERNEL_{op}": "ref" for op in REF_OPS})
        kda_module.kda, kda_module.causal_conv1d = _kda_in_forward, conv_fresh
        kda_ref_module._decayed_products = decayed_products_elementwise
        indexer_module.indexer_select = _select_in_forward
        sparse_mla_ref_module.QUERY_BLOCK = TRAIN_QUERY_BLOCK
        for module, name, function in compiled.values():
            setattr(module, name, function)
        if compile:
            _OPS["dense_experts"] = torch.compile(dense_experts, dynamic=True)
        for e, backend in zip(experts, backends, strict=True):
            e.backend = backend
        yield backends
    finally:
        (kda_module.kda, kda_module.causal_conv1d, indexer_module.indexer_select,
         sparse_mla_ref_module.QUERY_BLOCK, kda_ref_module._decayed_products) = saved
        for module, name, function in saved_compiled:
            setattr(module, name, function)
        _OPS["dense_experts"] = dense_experts
        for e in experts:
            e.backend = None
        for op, value in saved_env.items():
            if value is None:
                os.environ.pop(f"GLMFLASH_KERNEL_{op}", None)
            else:
                os.environ[f"GLMFLASH_KERNEL_{op}"] = value
