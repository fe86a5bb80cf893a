"""Fixtures of the end-to-end (acceptance) tests.

One in-process engine and one live HTTP server for the whole e2e session
(each is started lazily, by the first test that needs it), so the suite stays
fast on a 2-core machine. Both use ``logprobs_mode=raw_logits`` so logprob
entries are logits, comparable with ``shared/golden``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import SERVER_MAX_MODEL_LEN, EngineThread, LiveServer

from kvserve.config import CacheConfig, EngineConfig

#: KV cache of the in-process engine (364 blocks of 16 tokens).
ENGINE_KV_BYTES = 256 * 1024**2


@pytest.fixture(scope="session")
def e2e_engine(default_model_path: Path):
    """The shared in-process ``AsyncEngine`` (on its own event-loop thread)."""
    config = EngineConfig(model=str(default_model_path),
                          cache=CacheConfig(kv_cache_memory=ENGINE_KV_BYTES),
                          logprobs_mode="raw_logits")
    handle = EngineThread(config)
    yield handle
    handle.close()


@pytest.fixture(scope="session")
def e2e_tokenizer(default_model_path: Path):
    """The model's tokenizer, to turn token ids into the strings the API shows."""
    from kvserve.model.tokenizer import Tokenizer

    return Tokenizer(default_model_path)


@pytest.fixture(scope="session")
def _live_server_session(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-server"),
                        extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN)])
    yield server
    server.stop()


@pytest.fixture
def live_server(_live_server_session: LiveServer) -> LiveServer:
    """The shared ``kvserve serve`` subprocess; checked alive before and after each test."""
    _live_server_session.assert_alive()
    yield _live_server_session
    _live_server_session.assert_alive()


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
