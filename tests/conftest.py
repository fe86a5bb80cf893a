"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Folder of the default model's HF checkpoint (fetched and converted on first use).

    Honors ``$KVSERVE_CACHE``; tests using it should be marked ``@pytest.mark.model``.
    """
    from kvserve.model.default_model import ensure_default_model

    return ensure_default_model()
