"""Fixtures of the tools tests. ``LiveServer`` (a real ``kvserve serve``) comes
from ``tests/e2e/e2e_support.py``; the stub server from ``tools_support.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="module")
def stub_server():
    """Base URL of the stub server (uvicorn in a background thread, free port)."""
    from tools_support import StubServer

    stub = StubServer()
    yield stub.base_url
    stub.stop()
