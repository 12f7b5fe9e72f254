"""Model-level measures of the trained tiny checkpoint: the MTP layer against the main model, and
greedy bf16 against fp32 on the CPU."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from glmflash import Engine
from glmflash.config import ModelConfig
from glmflash.model.glm import GlmForCausalLM
from glmflash.model.mtp import GlmMtp, load_mtp, with_mtp_layer
from glmflash.model.state import ModelState
from glmflash.model.weights import load_checkpoint
from glmflash.sampling_params import SamplingParams
from tools.tiny_trainer import PAGE_SIZE, packed_batch


def load_with_mtp(checkpoint: Path) -> tuple[GlmForCausalLM, GlmMtp]:
    config = ModelConfig.from_hf(checkpoint)
    model = GlmForCausalLM(config, torch.float32)
    load_checkpoint(model, checkpoint, num_layers=config.num_hidden_layers, progress=False)
    mtp = GlmMtp(config, torch.float32)
    load_mtp(mtp, checkpoint)
    return model.eval(), mtp.eval()


@torch.no_grad()
def mtp_hits(checkpoint: Path, sequences: list[list[int]], group: int = 16) -> list[list[bool]]:
    """Per sequence, per row t: whether the MTP layer's top-1 for token t+2 equals the main
    model's top-1 at position t+1 (both given the same tokens up to t+1), t = 0 .. len - 3."""
    model, mtp = load_with_mtp(checkpoint)
    hits = []
    for i in range(0, len(sequences), group):
        part = sequences[i:i + group]
        pages = -(-max(map(len, part)) // PAGE_SIZE)
        state = ModelState(with_mtp_layer(model.config), num_token_slots=len(part) * pages *
                           PAGE_SIZE, num_state_slots=len(part), dtype=torch.float32,
                           device="cpu")
        batch = packed_batch([len(s) for s in part], np.concatenate(part), "cpu")
        hidden = model.hidden_states(batch, state)
        main_top = model.logits(hidden).argmax(-1)
        rows = torch.cat([torch.arange(a, b - 1) for a, b in
                          zip(batch.cu_seqlens[:-1], batch.cu_seqlens[1:], strict=True)])
        mtp_batch = packed_batch([len(s) - 1 for s in part], np.concatenate([s[1:] for s in part]),
                                 "cpu")
        mtp_top = model.logits(mtp(hidden[rows], model.text.embed_tokens(mtp_batch.input_ids),
                                   mtp_batch, state)).argmax(-1)
        j = 0
        for b, seq in enumerate(part):
            start = batch.cu_seqlens[b]
            # Row t predicts token t+2; the main model predicts it at position t+1.
            hits.append([bool(mtp_top[j + t] == main_top[start + t + 1])
                         for t in range(len(seq) - 2)])
            j += len(seq) - 1
    return hits


def mtp_agreement(hits: list[list[bool]], prompt_lens: list[int]) -> float:
    """Share of the generated positions (from the first generated token) where the MTP layer
    agrees with the main model (`mtp_hits`)."""
    kept = [h for seq, n in zip(hits, prompt_lens, strict=True) for h in seq[max(n - 2, 0):]]
    return round(sum(kept) / max(1, len(kept)), 4)


def scheduled_acceptance(hits: list[list[bool]], prompt_lens: list[int]) -> tuple[int, int]:
    """(drafts, accepted) that greedy decoding with one MTP draft a step verifies over these
    outputs: the first draft (row n - 1) predicts the second generated token; an accepted draft
    commits two tokens (the next draft two rows on), a rejected one the main model's token (the
    next row). An accepted draft of the output's last token ends it there, and the engine
    counts that token as the step's own, not as a draft (`SpecDecoder.count_output`). Greedy
    verification is exact, so the engine's counts must equal these."""
    drafts = accepted = 0
    for seq, n in zip(hits, prompt_lens, strict=True):
        t = n - 1
        while t < len(seq):
            if not (seq[t] and t == len(seq) - 1):
                drafts += 1
                accepted += seq[t]
            t += 2 if seq[t] else 1
    return drafts, accepted


def greedy_outputs(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [r.token_ids for r in engine.generate(prompt_token_ids=prompts, sampling_params=params)]


def greedy_agreement(reference: list[list[int]], outputs: list[list[int]]) -> dict:
    """The share of reference output positions holding the same token in `outputs` (free
    running: after a first difference the rest usually differs), and of identical outputs."""
    same = sum(sum(int(a == b) for a, b in zip(ref, out, strict=False))
               for ref, out in zip(reference, outputs, strict=True))
    identical = sum(r == o for r, o in zip(reference, outputs, strict=True))
    return dict(position_agreement=round(same / max(1, sum(map(len, reference))), 4),
                identical_outputs=round(identical / len(reference), 4),
                num_prompts=len(reference))


def bf16_agreement(checkpoint: Path, fp32_engine: Engine, prompts: list[list[int]],
                   max_tokens: int) -> dict:
    """Greedy outputs of a bf16 CPU engine against the fp32 one."""
    reference = greedy_outputs(fp32_engine, prompts, max_tokens)
    bf16 = Engine(checkpoint, device="cpu", dtype="bfloat16", context_length=2048,
                  skip_kernel_warmup=True)
    try:
        return greedy_agreement(reference, greedy_outputs(bf16, prompts, max_tokens))
    finally:
        bf16.shutdown()
