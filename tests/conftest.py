"""Shared pytest fixtures."""

from __future__ import annotations

import os

# Before numba is first imported: the CUDA backend's tests (tests/cuda, the
# "cuda-sim" backend of the model tests) run on Numba's CUDA simulator unless
# NUMBA_ENABLE_CUDASIM=0 selects a real GPU.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")

from pathlib import Path  # noqa: E402

import pytest

from kvserve.thread_env import apply_thread_pool_env  # noqa: E402

# Before NumPy and Numba's OpenMP layer load: the thread pools' spin limits
# that the kvserve command sets (import kvserve no longer does).
apply_thread_pool_env()


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Folder of the default model's HF checkpoint (fetched and converted on first use).

    Honors ``$KVSERVE_CACHE``; tests using it should be marked ``@pytest.mark.model``.
    """
    from kvserve.model.default_model import ensure_default_model

    return ensure_default_model()


def pytest_report_header(config) -> str:
    """Say at the top of every run whether the golden outputs were found."""
    from golden import golden_cases, missing_message

    try:
        cases = golden_cases()
    except (FileNotFoundError, ValueError) as exc:
        return f"golden: REQUIRED AND UNUSABLE -- {exc}"
    if not cases:
        return f"golden: MISSING, the golden tests will skip -- {missing_message()}"
    return f"golden: {len(cases)} cases"
