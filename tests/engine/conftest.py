"""Fixtures for the in-process engine tests (see ``engine_harness``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine_harness import DEFAULT_KV_MEMORY, EngineHandle, EngineLoop
from kvserve.config import CacheConfig


@pytest.fixture(scope="session")
def engine_loop(default_model_path) -> Iterator[EngineLoop]:
    loops = EngineLoop(str(default_model_path))
    try:
        yield loops
    finally:
        loops.close()


@pytest.fixture(scope="session")
def default_engine(engine_loop: EngineLoop) -> EngineHandle:
    """Prefix caching on, default budget, 182 KV blocks."""
    return engine_loop.get(shared=True)


@pytest.fixture(scope="session")
def no_prefix_engine(engine_loop: EngineLoop) -> EngineHandle:
    """As ``default_engine`` with prefix caching off."""
    return engine_loop.get(cache=CacheConfig(kv_cache_memory=DEFAULT_KV_MEMORY,
                                             enable_prefix_caching=False), shared=True)


@pytest.fixture(autouse=True, scope="module")
def _stop_the_modules_engines() -> Iterator[None]:
    """After each module, the engines it started through ``engine_loop.get``
    (all but the two shared ones) stop: the suite's memory stays bounded."""
    yield
    for loop in list(EngineLoop.live):
        loop.release()
