"""glmflash: an inference engine for GLM-5.3-Flash."""

from __future__ import annotations

__version__ = "0.1.0"

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
