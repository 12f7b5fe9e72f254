"""The sampling rule of a verify step: every row of a sequence draws as a plain step would at
that output position, so rows are independent draws of their own distributions. A greedy draft
is then kept with probability p(draft), and the token that replaces a rejected one follows p
without the draft, renormalised (the standard rejection rule)."""

from __future__ import annotations

import torch

from glmflash.engine.sampler import Sampler, unpack
from glmflash.engine.sequence import Sequence
from glmflash.sampling_params import SamplingParams

NUM_SEEDS = 3000


def _draw(logits: torch.Tensor) -> torch.Tensor:
    """`[NUM_SEEDS, 2]` tokens: two rows (offsets 0 and 1) of one sequence per seed."""
    seqs = [Sequence(s, [1], SamplingParams(temperature=1.0, seed=s)) for s in range(NUM_SEEDS)]
    rows = [seq for seq in seqs for _ in range(2)]
    out = Sampler().sample_on_device(logits.repeat(NUM_SEEDS, 1), rows, [0, 1] * NUM_SEEDS)
    return torch.tensor(unpack(out)[0]).view(NUM_SEEDS, 2)


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_rows_of_a_verify_are_independent_draws():
    # Both rows have the same distribution: drawing them with the same noise (one position)
    # would make them always equal, which the joint check below rejects.
    row = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0])
    probs = torch.softmax(row, dim=0)
    tokens = _draw(torch.stack([row, row]))
    vocab = row.numel()
    for column in (0, 1):
        assert _tv(torch.bincount(tokens[:, column], minlength=vocab).float(), probs) < 0.03
    joint = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    assert _tv(joint.float(), torch.outer(probs, probs).flatten()) < 0.06


def test_rejection_rule_of_a_greedy_draft():
    row = torch.tensor([1.2, 0.3, -0.5, 0.9, 0.0])
    probs = torch.softmax(row, dim=0)
    draft = int(probs.argmax())
    first = _draw(torch.stack([row, row]))[:, 0]
    accepted = first == draft
    assert abs(float(accepted.float().mean()) - float(probs[draft])) < 0.03
    residual = probs.clone()
    residual[draft] = 0
    counts = torch.bincount(first[~accepted], minlength=row.numel()).float()
    assert _tv(counts, residual / residual.sum()) < 0.04
