"""Fixtures of the end-to-end (acceptance) tests.

One in-process engine and one live HTTP server for the folder (each is
started by the first test that needs it and stopped when the run leaves
the folder), so the suite stays
fast on a 2-core machine. Both use ``logprobs_mode=raw_logits`` so logprob
entries are logits, comparable with ``shared/golden``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import SERVER_MAX_MODEL_LEN, EngineThread, LiveServer
from folder_scope import FolderScoped, folder_resource

from kvserve.config import CacheConfig, EngineConfig

HERE = Path(__file__).parent

#: KV cache of the in-process engine (364 blocks of 16 tokens).
ENGINE_KV_BYTES = 256 * 1024**2


@pytest.fixture(scope="session")
def _e2e_engines(default_model_path: Path):
    config = EngineConfig(model=str(default_model_path),
                          cache=CacheConfig(kv_cache_memory=ENGINE_KV_BYTES),
                          logprobs_mode="raw_logits")
    yield from folder_resource(HERE, lambda: EngineThread(config), EngineThread.close)


@pytest.fixture(scope="module")
def e2e_engine(_e2e_engines: FolderScoped[EngineThread]) -> EngineThread:
    """The folder's in-process ``AsyncEngine`` (on its own event-loop thread),
    stopped when the run leaves the folder."""
    return _e2e_engines.get()


@pytest.fixture(scope="session")
def e2e_tokenizer(default_model_path: Path):
    """The model's tokenizer, to turn token ids into the strings the API shows."""
    from kvserve.model.tokenizer import Tokenizer

    return Tokenizer(default_model_path)


@pytest.fixture(scope="session")
def _live_servers(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from folder_resource(
        HERE, lambda: LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-server"),
                                 extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN)]),
        LiveServer.stop)


@pytest.fixture
def live_server(_live_servers: FolderScoped[LiveServer]) -> LiveServer:
    """The folder's ``kvserve serve`` subprocess (stopped when the run leaves
    the folder); checked alive before and after each test."""
    server = _live_servers.get()
    server.assert_alive()
    yield server
    server.assert_alive()


@pytest.fixture
def http(live_server: LiveServer):
    """An httpx client on the live server (its timeout a hang deadline)."""
    with httpx.Client(base_url=live_server.base_url,
                      timeout=httpx.Timeout(HANG_DEADLINE_S, connect=60.0)) as client:
        yield client


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Attach the server's log to the report of a failed test that used it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "live_server" in getattr(item, "fixturenames", ()):
        server = item.funcargs.get("live_server") if hasattr(item, "funcargs") else None
        if isinstance(server, LiveServer):
            report.sections.append(("kvserve server log (tail)", server.log_tail()))
