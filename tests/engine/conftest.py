"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

import glmflash.engine.spec_capture as spec_capture
from tests.engine.spec_helpers import record_rerun


@pytest.fixture
def rerun_graphs(monkeypatch):
    """Spec graphs captured as forwards that each replay runs again (no CUDA needed)."""
    monkeypatch.setattr(spec_capture, "record", record_rerun)
    monkeypatch.setattr(spec_capture, "staging", lambda packed: torch.empty_like(packed))
