"""Issue 25: bodies that used to cost the server seconds are refused before
the work -- a chat of more messages than the context can hold is a 400
before validation or rendering -- and a SIGTERM's shutdown is bounded."""

from __future__ import annotations

import asyncio
import signal
import threading

import pytest
import uvicorn
from fake_engine import FakeEngine

from kvserve.api import server as server_module
from kvserve.api.server import DrainingServer
from kvserve.config import ServerConfig


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(max_request_bytes=1 << 20)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_more_messages_than_the_context_holds_is_a_400_before_any_work(
        client, engine: FakeEngine, path: str) -> None:
    # FakeEngine: max_model_len 4096, a template of >= 1 token a message.
    messages = [{"role": "user", "content": "x"}] * 5000
    messages[4999] = {"role": "user", "content": 7}  # invalid, but never validated
    response = await client.post(path, json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert "5,000 messages need at least 5,000 tokens" in error["message"], error
    assert engine.requests == []


@pytest.mark.anyio
async def test_as_many_messages_as_tokens_still_pass(client, engine: FakeEngine) -> None:
    messages = [{"role": "user", "content": "x"}] * 4096
    response = await client.post("/v1/chat/completions",
                                 json={"messages": messages, "max_tokens": 3})
    assert response.status_code == 200, response.text
    assert len(engine.requests[0].messages) == 4096


class _StuckEngine:
    """An engine whose drain never ends (a tokenizer or compile that hangs)."""

    async def drain(self, timeout: float) -> int:
        await asyncio.Event().wait()
        return 0


def test_a_shutdown_that_hangs_ends_the_process_past_the_drain_timeout(monkeypatch) -> None:
    monkeypatch.setattr(server_module, "FORCED_EXIT_GRACE", 0.2)
    exited = threading.Event()
    statuses: list[int] = []

    def exit_process(status: int) -> None:
        statuses.append(status)
        exited.set()

    async def go() -> None:
        config = uvicorn.Config(app=None, log_config=None)  # leaves logging alone
        server = DrainingServer(config, _StuckEngine(), drain_timeout=0.3,
                                exit_process=exit_process)
        server._loop = asyncio.get_running_loop()
        server.handle_exit(signal.SIGTERM, None)
        assert not exited.is_set()  # armed, not fired
        await asyncio.get_running_loop().run_in_executor(None, exited.wait, 30)

    asyncio.run(go())
    assert statuses == [server_module.FORCED_EXIT_STATUS] == [1]


def test_the_forced_exit_grace_can_be_set_for_a_loaded_machine(monkeypatch):
    """``KVSERVE_SHUTDOWN_GRACE_S`` sets the seconds past the drain after which
    a shutdown is forced (issue 47, item 13: a clean stop took more than the
    default 4 s at a load of 9.5); nonsense keeps the default."""
    for value, seconds in (("60", 60.0), ("0", 4.0), ("-1", 4.0), ("soon", 4.0)):
        monkeypatch.setenv(server_module.SHUTDOWN_GRACE_ENV, value)
        assert server_module.forced_exit_grace() == seconds
    monkeypatch.delenv(server_module.SHUTDOWN_GRACE_ENV)
    assert server_module.forced_exit_grace() == server_module.FORCED_EXIT_GRACE == 4.0
