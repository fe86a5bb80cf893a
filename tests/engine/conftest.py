"""Fixtures for the in-process engine tests (see ``engine_harness``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from folder_scope import FolderScoped, folder_resource

from engine_harness import DEFAULT_KV_MEMORY, EngineHandle, EngineLoop
from kvserve.config import CacheConfig


@pytest.fixture(scope="session")
def _engine_loops(default_model_path) -> Iterator[FolderScoped[EngineLoop]]:
    yield from folder_resource(Path(__file__).parent,
                               lambda: EngineLoop(str(default_model_path)), EngineLoop.close)


@pytest.fixture(scope="module")
def engine_loop(_engine_loops: FolderScoped[EngineLoop]) -> EngineLoop:
    """The folder's event loop and engines (stopped when the run leaves the folder)."""
    return _engine_loops.get()


@pytest.fixture
def default_engine(engine_loop: EngineLoop) -> EngineHandle:
    """Prefix caching on, default budget, 182 KV blocks."""
    return engine_loop.get(shared=True)


@pytest.fixture
def no_prefix_engine(engine_loop: EngineLoop) -> EngineHandle:
    """As ``default_engine`` with prefix caching off; stopped with the module
    that asked for it (three modules do), so that it is not alive beside the
    engines of later modules (each holds ~690 MiB: weights, KV cache)."""
    return engine_loop.get(cache=CacheConfig(kv_cache_memory=DEFAULT_KV_MEMORY,
                                             enable_prefix_caching=False))


@pytest.fixture(autouse=True, scope="module")
def _stop_the_modules_engines() -> Iterator[None]:
    """After each module, the engines it started through ``engine_loop.get``
    (all but the shared default one) stop: the suite's memory stays bounded."""
    yield
    for loop in list(EngineLoop.live):
        loop.release()
