"""mHC stream collapse (pre) and expand-and-mix (post)."""

from __future__ import annotations

from glmflash.kernels.hyper.ref import hyper_post_ref, hyper_pre_ref

hyper_pre = hyper_pre_ref
hyper_post = hyper_post_ref

__all__ = ["hyper_post", "hyper_post_ref", "hyper_pre", "hyper_pre_ref"]
