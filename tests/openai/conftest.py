"""Fixtures of the OpenAI-compatibility acceptance tests (issue 5).

One live ``kvserve serve`` subprocess for the whole folder (started by the
first test that needs it), with ``--api-key`` set, so the auth test and the
others share it; the default ``--logprobs-mode processed_logprobs`` (the
e2e helper's ``raw_logits`` is overridden: argparse keeps the last value).
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

from e2e_support import LiveServer  # noqa: E402
from folder_scope import FolderScoped, folder_resource  # noqa: E402

API_KEY = "test-key-5"
MAX_MODEL_LEN = 512
MAX_REQUEST_BYTES = 65536
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="session")
def _openai_servers(default_model_path: Path, tmp_path_factory: pytest.TempPathFactory):
    yield from folder_resource(
        Path(__file__).parent,
        lambda: LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-openai"),
                           extra_args=["--max-model-len", str(MAX_MODEL_LEN),
                                       "--logprobs-mode", "processed_logprobs",
                                       "--api-key", API_KEY,
                                       "--max-request-bytes", str(MAX_REQUEST_BYTES)]),
        LiveServer.stop)


@pytest.fixture
def openai_server(_openai_servers: FolderScoped[LiveServer]) -> LiveServer:
    """The folder's live server (stopped when the run leaves the folder)."""
    return _openai_servers.get()


@pytest.fixture
def server(openai_server: LiveServer) -> LiveServer:
    """The shared server, checked alive before and after each test."""
    openai_server.assert_alive()
    yield openai_server
    openai_server.assert_alive()


@pytest.fixture
def http(server: LiveServer):
    """An httpx client on the live server, with the API key."""
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=httpx.Timeout(180.0, connect=10.0)) as client:
        yield client


@pytest.fixture
def oai(server: LiveServer):
    """The official ``openai`` client, unmodified, on the live server."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                           timeout=180.0)
    yield client
    client.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Attach the server's log to the report of a failed test that used it."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "server" in getattr(item, "fixturenames", ()):
        server = item.funcargs.get("server") if hasattr(item, "funcargs") else None
        if isinstance(server, LiveServer):
            report.sections.append(("kvserve server log (tail)", server.log_tail()))
