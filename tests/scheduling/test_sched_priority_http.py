"""Acceptance (issue 4) through HTTP: ``X-Priority`` against live servers with
one sequence slot, under ``--scheduling-policy priority`` and ``fcfs``; the
400 for a priority under fcfs; the header winning over the body field.

Order is the order in which the clients saw their streams end (``[DONE]``).
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import LiveServer
from sched_support import (PROMPT, HTTPRecord, assert_error_body, chat_body, sse_stream,
                           wait_until)

pytestmark = pytest.mark.model

LONG_TOKENS = 30
SHORT_TOKENS = 4
LOW = 5


def _server(model, tmp_path_factory, policy):
    return LiveServer(model, tmp_path_factory.mktemp(f"kvserve-{policy}"),
                      extra_args=["--scheduling-policy", policy, "--max-num-seqs", "1",
                                  "--max-model-len", "512"])


@pytest.fixture(scope="module")
def priority_server(default_model_path, tmp_path_factory):
    server = _server(default_model_path, tmp_path_factory, "priority")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fcfs_server(default_model_path, tmp_path_factory):
    server = _server(default_model_path, tmp_path_factory, "fcfs")
    yield server
    server.stop()


def _client(server: LiveServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url,
                             timeout=httpx.Timeout(HANG_DEADLINE_S, connect=60.0))


async def _scenario(server: LiveServer, low: int, urgent_headers: dict, urgent_extra: dict):
    """One long low-priority request runs, five low ones wait (each admitted:
    its 200 arrived), then the urgent one is sent. Returns the records."""
    async with _client(server) as client:
        running = asyncio.Event()
        long = HTTPRecord("long")
        tasks = [asyncio.ensure_future(sse_stream(
            client, chat_body(PROMPT, LONG_TOKENS), headers={"X-Priority": str(low)},
            first_content=running, record=long))]
        await wait_until(running.is_set, "the long request streaming")
        lows = []
        for i in range(5):
            answered, record = asyncio.Event(), HTTPRecord(f"low-{i}")
            tasks.append(asyncio.ensure_future(sse_stream(
                client, chat_body(f"{PROMPT} ({i})", SHORT_TOKENS),
                headers={"X-Priority": str(low)}, accepted=answered, record=record)))
            await wait_until(answered.is_set, f"low-{i} answered")
            assert record.status == 200, record
            lows.append(record)
        urgent = HTTPRecord("urgent")
        tasks.append(asyncio.ensure_future(sse_stream(
            client, chat_body(f"{PROMPT} (urgent)", SHORT_TOKENS, **urgent_extra),
            headers=urgent_headers, record=urgent)))
        await asyncio.gather(*tasks)
    records = [long, *lows, urgent]
    for r in records:
        assert r.status == 200 and r.done and not r.errors, r
        assert r.usage["completion_tokens"] == (LONG_TOKENS if r is long else SHORT_TOKENS), r
    # Which low requests were still waiting when the urgent one was sent
    # (with one slot and a long request running: all of them).
    waiting = [r for r in lows if r.first_content_at is None
               or r.first_content_at > urgent.sent_at]
    assert len(waiting) >= 4, "test precondition: the low requests should be queued"
    return long, lows, urgent, waiting


def _order(records):
    return [r.name for r in sorted(records, key=lambda r: r.done_at)]


@pytest.mark.slow
def test_http_priority_header_urgent_finishes_before_waiting_low(priority_server):
    long, lows, urgent, waiting = asyncio.run(
        _scenario(priority_server, LOW, {"X-Priority": "0"}, {}))
    order = _order([long, *lows, urgent])
    for r in waiting:
        assert urgent.done_at < r.done_at, order
    assert order[0] == "urgent", order  # it also preempted the running long one
    priority_server.assert_alive()


@pytest.mark.slow
def test_http_fcfs_urgent_finishes_last(fcfs_server):
    long, lows, urgent, waiting = asyncio.run(_scenario(fcfs_server, 0, {}, {}))
    order = _order([long, *lows, urgent])
    assert order[-1] == "urgent", order
    assert order == ["long", *(r.name for r in lows), "urgent"]
    fcfs_server.assert_alive()


@pytest.mark.parametrize("headers,body_priority", [({"X-Priority": "3"}, None), ({}, 3)],
                         ids=["header", "body"])
def test_http_fcfs_non_zero_priority_is_400_naming_the_flag(fcfs_server, headers,
                                                            body_priority):
    extra = {} if body_priority is None else {"priority": body_priority}
    with httpx.Client(base_url=fcfs_server.base_url, timeout=HANG_DEADLINE_S) as client:
        for stream in (False, True):
            response = client.post("/v1/chat/completions", headers=headers,
                                   json=chat_body("Hi", 2, stream=stream, **extra))
            assert response.status_code == 400, response.text
            error = assert_error_body(response.json(), 400)
            assert "--scheduling-policy priority" in error["message"], error


def test_http_header_wins_over_body_priority(fcfs_server):
    """Under fcfs only priority 0 is allowed, so the status tells which of
    header and body was used: the header, whichever way round."""
    with httpx.Client(base_url=fcfs_server.base_url, timeout=HANG_DEADLINE_S) as client:
        response = client.post("/v1/chat/completions", headers={"X-Priority": "0"},
                               json=chat_body("Hi", 2, priority=3, stream=False))
        assert response.status_code == 200, response.text
        response = client.post("/v1/chat/completions", headers={"X-Priority": "3"},
                               json=chat_body("Hi", 2, priority=0, stream=False))
        assert response.status_code == 400, response.text
