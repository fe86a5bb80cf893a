"""Client disconnects make the API call ``engine.abort`` (raw ASGI calls)."""

from __future__ import annotations

import json

import anyio
import pytest
from fake_engine import FakeEngine, accepted, sample_outputs

from kvserve.api import build_app
from kvserve.config import ServerConfig

pytestmark = pytest.mark.anyio


def scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
            "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("test", 80)}


async def call(engine: FakeEngine, path: str, payload: dict, leave: anyio.Event,
               send_error: bool = False) -> list[dict]:
    """Run one request; the client disconnects once ``leave`` is set."""
    app = build_app(engine, ServerConfig())
    body = json.dumps(payload).encode()
    sent: list[dict] = []
    first = True

    async def receive() -> dict:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if send_error and leave.is_set():
            raise OSError("connection reset")
        sent.append(message)
        if message["type"] == "http.response.body" and b"Hi" in message.get("body", b""):
            leave.set()

    with anyio.fail_after(5):
        await app(scope(path), receive, send)
    return sent


def hanging_after_first_token(req):
    return [accepted(req), *sample_outputs(req, 0, ["Hi", "never"])[:1]]


async def test_non_streaming_disconnect_aborts():
    engine = FakeEngine(script=lambda req: [accepted(req)])
    leave = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(call, engine, "/v1/completions", {"prompt": "x"}, leave)
        await anyio.sleep(0.05)
        leave.set()
    assert engine.aborted == [engine.requests[0].request_id]


async def test_disconnect_before_acceptance_aborts():
    engine = FakeEngine(script=lambda req: [])
    leave = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(call, engine, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "stream": True}, leave)
        await anyio.sleep(0.05)
        leave.set()
    assert engine.aborted == [engine.requests[0].request_id]


@pytest.mark.parametrize("send_error", [False, True])
async def test_streaming_disconnect_aborts(send_error):
    engine = FakeEngine(script=hanging_after_first_token)
    sent = await call(engine, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "x"}], "stream": True},
                      anyio.Event(), send_error=send_error)
    assert sent[0]["status"] == 200
    assert engine.aborted == [engine.requests[0].request_id]


async def test_finished_stream_is_not_aborted():
    engine = FakeEngine()
    sent = await call(engine, "/v1/completions", {"prompt": "x", "stream": True}, anyio.Event())
    assert sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert engine.aborted == []


async def test_a_client_leaving_mid_upload_is_one_info_line_not_a_server_error():
    """Issue 14, item 6: a body cut short by the client (Content-Length 100,
    2 bytes sent, then gone) logged 47 lines of traceback as an unhandled
    server error. Now: one info event, a 499 to nobody, no engine call."""
    from structlog.testing import capture_logs

    engine = FakeEngine()
    app = build_app(engine, ServerConfig())
    req_scope = scope("/v1/chat/completions")
    req_scope["headers"] = req_scope["headers"] + [(b"content-length", b"100"),
                                                   (b"x-request-id", b"upload-1")]
    messages = iter([{"type": "http.request", "body": b"{\"a", "more_body": True},
                     {"type": "http.disconnect"}])
    sent: list[dict] = []

    async def receive() -> dict:
        return next(messages)

    async def send(message: dict) -> None:
        sent.append(message)

    with capture_logs() as logs:
        await app(req_scope, receive, send)
    assert sent[0]["status"] == 499, sent
    assert engine.requests == []
    assert [e["event"] for e in logs] == ["client_disconnected"], logs
    assert logs[0]["log_level"] == "info" and logs[0]["request_id"] == "upload-1"
    assert logs[0]["bytes_received"] == 3
