"""glmflash: an inference engine for GLM-5.3-Flash."""

from __future__ import annotations

__version__ = "0.1.0"
