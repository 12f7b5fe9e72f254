"""Token choice from last-token logits, batched on the logits' device.

Covers greedy, temperature, top-k, top-p, min-p, penalties, logits processors, per-request seeds
and logprobs. A step copies back to the host once: the sampled ids and the requested logprobs.
Rows draw by the exponential race, `argmax(probs / E)` with `E ~ Exp(1)` per token, which picks
token i with probability `probs[i] / sum(probs)`; `E` comes from a counter-based hash
(engine/rng.py), so a seeded row's draw depends on its seed, output position and logits only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glmflash.engine.penalties import PenaltyState
from glmflash.engine.rng import exponential_noise
from glmflash.engine.sampling_tensors import SamplingTensors
from glmflash.engine.sequence import Sequence

_INT64_MAX = 2**63 - 1


@dataclass(slots=True)
class SampleOutput:
    """One step's choice: ids on the device and their copy to the host, under way."""

    token_ids_gpu: torch.Tensor
    """`[B]` int64 sampled ids on the logits' device."""
    packed_cpu: torch.Tensor
    """int32 host copy (pinned on CUDA): B ids, then for the R logprob rows K top ids, K top
    logprobs and the sampled id's logprob (fp32 bits); valid once `copy_done` has completed."""
    copy_done: torch.cuda.Event | None
    """Recorded after the copy; None when the logits are on the CPU (the copy is done)."""
    num_logprobs: list[int | None]
    """`[B]` the logprobs each row asked for (SamplingParams.logprobs)."""
    errors: dict[int, str]
    """Rows whose logits processor raised, with the error; their ids are meaningless."""


class Sampler:
    def __init__(self, seed: int | None = None, *, sleep_while_waiting: bool = False) -> None:
        """`sleep_while_waiting`: the host waits for the copy back asleep instead of spinning
        (hybrid serving: a spinning host thread takes a core from the CPU experts)."""
        self.sleep_while_waiting = sleep_while_waiting
        self.generator = torch.Generator()
        """Draws the key of unseeded rows once per step."""
        if seed is not None:
            self.generator.manual_seed(seed)
        self.penalties = PenaltyState()
        self.errors: dict[int, str] = {}
        """Rows of the last `sample` call whose logits processor raised (SampleOutput.errors)."""

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per sequence; records top logprobs on the sequence when asked.

        A row whose logits processor raised is in `self.errors`; its id must not be used.
        """
        out = self.sample_on_device(logits, seqs)
        token_ids, logprobs = unpack(out)
        for seq, entry in zip(seqs, logprobs, strict=True):
            if entry is not None:
                seq.logprobs.append(entry)
        self.errors = out.errors
        return token_ids

    def sample_on_device(self, logits: torch.Tensor, seqs: list[Sequence],
                         output_offsets: list[int] | None = None) -> SampleOutput:
        """Choose every row's token on the logits' device with no host sync; start the copy back.

        `output_offsets`: per row, how many tokens past the sequence's end it draws (a verify
        step's rows after its first; default 0), so each output position has its own noise.

        NOTE: each sampled id is taken to be appended to its sequence (penalty counts follow the
        ids on the device); a sequence whose tokens then differ is recounted from its tokens.
        """
        assert logits.shape[0] == len(seqs)
        t = SamplingTensors.build(seqs, logits.shape[1], logits.device, self._step_key(seqs),
                                  self.penalties, output_offsets)
        if t.is_plain_greedy:
            return _copy_back(logits, logits.argmax(dim=-1), seqs, t, {},
                              self.sleep_while_waiting)
        raw = logits.float()
        logits, errors = apply_processors(raw, seqs, t.processor_rows)
        if t.penalties is not None:
            logits = self.penalties.apply(logits, t.penalties)
        token_ids = choose(logits, t)
        if t.penalties is not None:
            self.penalties.count(token_ids, t.penalties)
        return _copy_back(raw, token_ids, seqs, t, errors, self.sleep_while_waiting)

    def release(self, seq: Sequence) -> None:
        self.penalties.release(seq.seq_id)

    def _step_key(self, seqs: list[Sequence]) -> int:
        """A fresh key when an unseeded row draws: reproducible for a fixed engine seed."""
        if all(s.params.is_greedy or s.params.seed is not None for s in seqs):
            return 0
        return int(torch.randint(_INT64_MAX, (), generator=self.generator))


def apply_processors(logits: torch.Tensor, seqs: list[Sequence],
                     rows: list[int]) -> tuple[torch.Tensor, dict[int, str]]:
    """Each of `rows` through its sequence's logits processors, in order, on the device.

    A processor that raises fails its row only: the error is returned and the row left as it was.
    """
    if not rows:
        return logits, {}
    logits, errors = logits.clone(), {}
    for i in rows:
        seq, row = seqs[i], logits[i]
        try:
            for processor in seq.params.logits_processors:
                row = processor(seq.output_token_ids, row)
            if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                raise TypeError(f"a logits processor must return a tensor of shape "
                                f"{tuple(logits[i].shape)}, got {_described(row)}")
            logits[i] = row
        except Exception as exc:  # user code: it ends its request, not the batch
            errors[i] = f"{type(exc).__name__}: {exc}"
    return logits, errors


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def choose(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """`[B]` ids: argmax for greedy rows, the exponential race over the filtered distribution
    for the others."""
    token_ids = logits.argmax(dim=-1)
    if t.sample_rows is None:
        return token_ids
    rows = logits.index_select(0, t.sample_rows) / t.temperature[:, None]
    probs = filter_probs(torch.softmax(rows, dim=-1), t.top_k if t.use_top_k_or_p else None,
                         t.top_p, t.min_p if t.use_min_p else None)
    noise = exponential_noise(t.keys, t.positions, logits.shape[1])
    return token_ids.index_copy(0, t.sample_rows, (probs / noise).argmax(dim=-1))


def filter_probs(probs: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                 min_p: torch.Tensor | None) -> torch.Tensor:
    """`probs` `[S, V]` with zeros outside top-k, top-p (smallest set with mass >= p) and min-p.

    `top_k` `[S]` (vocabulary size for no cut) and `top_p` `[S]` (inf for no cut) go together;
    None skips the sort. Each filter is decided on the unfiltered distribution, and the most
    likely token always stays.
    """
    keep = None
    if min_p is not None:
        keep = probs >= min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    if top_k is not None:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=probs.device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = (rank < top_k[:, None]) & (mass_before < top_p[:, None])
        keep_sorted[:, 0] = True
        kept = torch.empty_like(keep_sorted).scatter_(1, order, keep_sorted)
        keep = kept if keep is None else keep & kept
    return probs if keep is None else probs * keep


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row `[V]`: softmax restricted by top-k, top-p and min-p, renormalised."""
    device = logits.device
    probs = filter_probs(torch.softmax(logits, dim=-1)[None],
                         torch.tensor([top_k or logits.shape[0]], device=device),
                         torch.tensor([top_p if top_p < 1 else float("inf")], device=device),
                         torch.tensor([min_p], device=device))[0]
    return probs / probs.sum()


def _copy_back(raw: torch.Tensor, token_ids: torch.Tensor, seqs: list[Sequence],
               t: SamplingTensors, errors: dict[int, str], blocking: bool) -> SampleOutput:
    """Pack the ids and the requested logprobs into one int32 tensor and copy it to the host."""
    parts = [token_ids.int()]
    if t.logprob_rows is not None:
        logprobs = torch.log_softmax(raw.index_select(0, t.logprob_rows), dim=-1)
        top = logprobs.topk(max(t.num_logprobs), dim=-1)
        chosen = logprobs.gather(1, token_ids.index_select(0, t.logprob_rows)[:, None])
        parts += [top.indices.int().flatten(), top.values.view(torch.int32).flatten(),
                  chosen.view(torch.int32).flatten()]
    packed = torch.cat(parts) if len(parts) > 1 else parts[0]
    copy_done = None
    if packed.is_cuda:
        packed_cpu = torch.empty(packed.shape, dtype=torch.int32, pin_memory=True)
        packed_cpu.copy_(packed, non_blocking=True)
        copy_done = torch.cuda.Event(blocking=blocking)
        copy_done.record()
    else:
        packed_cpu = packed
    return SampleOutput(token_ids, packed_cpu, copy_done, [s.params.logprobs for s in seqs],
                        errors)


def unpack(out: SampleOutput) -> tuple[list[int], list[dict[int, float] | None]]:
    """Wait for the copy; the ids, and per row {token id: logprob} of the top k and the chosen
    token (the raw model distribution), or None where the row did not ask."""
    if out.copy_done is not None:
        out.copy_done.synchronize()
    num_rows = len(out.num_logprobs)
    token_ids = out.packed_cpu[:num_rows].tolist()
    if all(k is None for k in out.num_logprobs):
        return token_ids, [None] * num_rows
    return token_ids, _logprob_entries(out.packed_cpu[num_rows:], token_ids, out.num_logprobs)


def _logprob_entries(packed: torch.Tensor, token_ids: list[int],
                     num_logprobs: list[int | None]) -> list[dict[int, float] | None]:
    num_wanted = sum(k is not None for k in num_logprobs)
    num_top = max(k for k in num_logprobs if k is not None)
    width = num_wanted * num_top
    top_ids = packed[:width].view(num_wanted, num_top).tolist()
    top_values = packed[width:2 * width].view(torch.float32).view(num_wanted, num_top).tolist()
    chosen = iter(packed[2 * width:].view(torch.float32).tolist())
    entries, j = [], 0
    for token_id, k in zip(token_ids, num_logprobs, strict=True):
        entry = None
        if k is not None:
            entry = dict(zip(top_ids[j][:k], top_values[j][:k], strict=True))
            entry[token_id] = next(chosen)
            j += 1
        entries.append(entry)
    return entries
