"""KDA ops: `causal_conv1d` and `kda` (gated delta rule) over packed varlen batches."""

from __future__ import annotations

from glmflash.kernels.kda.ref import causal_conv1d_ref, kda_ref

causal_conv1d = causal_conv1d_ref
kda = kda_ref

__all__ = ["causal_conv1d", "causal_conv1d_ref", "kda", "kda_ref"]
