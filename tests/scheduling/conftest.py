"""Fixtures of the scheduling-policy tests (issue 4).

The helpers of ``tests/engine`` and ``tests/e2e`` are reused, so their
folders go on ``sys.path`` (pytest only adds them when it collects there).
Engines are started lazily, one per configuration, and live servers one per
module that needs them; every engine uses ``--max-num-seqs 1`` unless a test
says otherwise, which makes queueing order observable on 2 CPU cores.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parents[1]
for _folder in (_TESTS / "engine", _TESTS / "e2e"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

from engine_harness import EngineLoop  # noqa: E402
from folder_scope import FolderScoped, folder_resource  # noqa: E402


@pytest.fixture(scope="session")
def _sched_loops(default_model_path) -> Iterator[FolderScoped[EngineLoop]]:
    yield from folder_resource(Path(__file__).parent,
                               lambda: EngineLoop(str(default_model_path)), EngineLoop.close)


@pytest.fixture(scope="module")
def sched_loop(_sched_loops: FolderScoped[EngineLoop]) -> EngineLoop:
    """In-process engines (one per configuration) on one private event loop,
    stopped when the run leaves the folder."""
    return _sched_loops.get()
