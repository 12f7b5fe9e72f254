"""Token choice from last-token logits.

Covers greedy, temperature, top-k, top-p, min-p, per-request seeds and logprobs.
"""

from __future__ import annotations

import torch

from glmflash.engine.sequence import Sequence


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self.default_generator = torch.Generator()
        if seed is not None:
            self.default_generator.manual_seed(seed)
        self.generators: dict[int, torch.Generator] = {}

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per sequence; records top logprobs on the sequence when asked."""
        logits = logits.float().cpu()
        # Plain greedy rows (the common serving case) take one batched argmax.
        greedy = logits.argmax(dim=-1).tolist()
        tokens = []
        for i, (row, seq) in enumerate(zip(logits, seqs, strict=True)):
            token = greedy[i] if _is_plain_greedy(seq.params) else self._sample_one(row, seq)
            if seq.params.logprobs is not None:
                seq.logprobs.append(top_logprobs(row, token, seq.params.logprobs))
            tokens.append(token)
        return tokens

    def release(self, seq: Sequence) -> None:
        self.generators.pop(seq.seq_id, None)

    def _sample_one(self, row: torch.Tensor, seq: Sequence) -> int:
        params = seq.params
        for processor in params.logits_processors:
            row = processor(seq.output_token_ids, row)
        row = apply_penalties(row, seq)
        if params.is_greedy:
            return int(row.argmax())
        probs = filtered_probs(row / params.temperature, params.top_k, params.top_p, params.min_p)
        return int(torch.multinomial(probs, 1, generator=self._generator(seq)))

    def _generator(self, seq: Sequence) -> torch.Generator:
        if seq.params.seed is None:
            return self.default_generator
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return self.generators[seq.seq_id]


def _is_plain_greedy(params) -> bool:
    return params.is_greedy and not params.logits_processors and params.repetition_penalty == 1.0 \
        and not params.presence_penalty and not params.frequency_penalty


def apply_penalties(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Repetition (prompt + output), presence and frequency (output only) penalties."""
    params = seq.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = row[seen]
        row = row.clone()
        row[seen] = torch.where(vals > 0, vals / params.repetition_penalty,
                                vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and seq.num_output_tokens:
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.shape[0])
        counts = counts[: row.shape[0]].float()
        row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return row


def filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Softmax restricted by top-k, then top-p (smallest set with mass >= p), then min-p."""
    probs = torch.softmax(logits, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        keep &= mass_before < top_p
    if min_p > 0:
        keep &= sorted_probs >= min_p * sorted_probs[0]
    keep[0] = True
    filtered = torch.zeros_like(probs)
    filtered[order[keep]] = sorted_probs[keep]
    return filtered / filtered.sum()


def top_logprobs(row: torch.Tensor, token: int, k: int) -> dict[int, float]:
    """Log-probabilities of the top-k tokens and of the chosen one (raw model distribution)."""
    logp = torch.log_softmax(row, dim=-1)
    values, ids = logp.topk(k) if k else (logp[:0], torch.empty(0, dtype=torch.long))
    out = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    out[token] = float(logp[token])
    return out
