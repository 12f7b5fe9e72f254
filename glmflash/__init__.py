"""glmflash: an inference engine for GLM-5.3-Flash."""

from __future__ import annotations

from glmflash.utils.env import configure_openmp

__version__ = "0.1.0"
# Before torch is imported by glmflash (a user who imported torch first gets it only for numba).
configure_openmp()

__all__ = ["Engine", "Result", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so `import glmflash` stays cheap (the CLI's --help, the server's workers).
    if name in ("Engine", "Result"):
        from glmflash.engine import engine

        return getattr(engine, name)
    if name == "SamplingParams":
        from glmflash.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
