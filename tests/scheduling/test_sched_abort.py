"""Acceptance (issue 4): a client that leaves, or a request past its
``--request-timeout``, stops costing anything.

HTTP over real TCP to the Starlette app served by uvicorn on the engine's own
event loop (``AppServer``), so closing the socket is a real disconnect for the
API, while the test reads the engine's scheduler and KV cache directly. The
engine has one sequence slot: a request that kept running after its client
left would hold that slot for hundreds of tokens.

No wall-clock bound (issue 33): the issue's "within one second" is checked by
its cause, the engine steps that still carried the request after its client
left (the one in flight and the one planned behind it, at most), and "the
next request is not held up" by the steps of that next request: its first
step is its own prefill and samples its first token.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import httpx
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from e2e_support import EngineThread, kv_snapshot, post_stream
from sched_support import PROMPT, AppServer, assert_error_body, chat_body

from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig

pytestmark = pytest.mark.model

LONG_TOKENS = 400  # ~15 s of decoding alone on 2 CPU cores: never finishes in a test
#: Steps that may still carry a request after its client left: the step in
#: flight and the one already planned behind it (async scheduling), and one
#: more for the abort to travel API -> tokenizer -> admission -> scheduler.
MAX_STEPS_AFTER_LEAVING = 3


@pytest.fixture(scope="module")
def app_server(default_model_path):
    config = EngineConfig(model=str(default_model_path),
                          cache=CacheConfig(kv_cache_memory=128 * 1024**2),
                          scheduler=SchedulerConfig(max_num_seqs=1))
    engine_thread = EngineThread(config)
    try:
        server = AppServer(engine_thread)
        try:
            yield server
        finally:
            server.close()
    finally:
        engine_thread.close()


@pytest.fixture
def http(app_server):
    with httpx.Client(base_url=app_server.base_url,
                      timeout=httpx.Timeout(HANG_DEADLINE_S, connect=60.0)) as client:
        yield client


async def _engine_state(engine, request_id: str | None = None) -> dict:
    scheduler = engine.core.scheduler
    snap = await kv_snapshot(engine)
    return {"num_running": scheduler.num_running, "num_waiting": engine.load.num_waiting,
            "usage": snap.usage, "held": snap.held,
            "live": request_id is not None and scheduler.get_request(request_id) is not None}


def _state(app_server, request_id: str | None = None) -> dict:
    return app_server.engine_thread.run(_engine_state(app_server.engine_thread.engine,
                                                      request_id))


def _wait_state(app_server, predicate, what: str, request_id: str | None = None,
                timeout: float = HANG_DEADLINE_S) -> dict:
    """Poll the engine until ``predicate(state)``; the state then. ``timeout``
    is a hang deadline (its failure says the load average and the state)."""
    deadline = time.monotonic() + timeout
    while True:
        state = _state(app_server, request_id)
        if predicate(state):
            return state
        assert time.monotonic() < deadline, f"{hang_message(what, timeout)}: {state}"
        time.sleep(0.01)


@contextmanager
def _recorded_steps(app_server):
    """Every non-empty ``SchedulerOutput`` the engine's scheduler builds
    meanwhile (appended on the engine's thread)."""
    scheduler = app_server.engine_thread.engine.core.scheduler
    steps = []
    original = scheduler.schedule

    def recording(*args, **kwargs):
        output = original(*args, **kwargs)
        if output.scheduled:
            steps.append(output)
        return output

    scheduler.schedule = recording
    try:
        yield steps
    finally:
        del scheduler.schedule


def _short_stream(http: httpx.Client) -> None:
    """A short streaming chat request, read to its end (it has content)."""
    with http.stream("POST", "/v1/chat/completions",
                     json=chat_body("Say hello.", 4)) as response:
        assert response.status_code == 200
        lines = list(response.iter_lines())
    assert any(line.startswith("data:") and '"content"' in line and '"content":""' not in line
               for line in lines), lines


def _idle(state: dict) -> bool:
    return state["num_running"] == 0 and state["num_waiting"] == 0 and not state["held"]


def test_streaming_client_leaving_after_two_chunks_frees_everything(app_server, http):
    _short_stream(http)  # warm-up
    baseline = _wait_state(app_server, _idle, "the engine did not go idle")

    request_id = "sched-disconnect-1"
    with _recorded_steps(app_server) as steps, \
            httpx.Client(base_url=app_server.base_url, timeout=HANG_DEADLINE_S) as leaving:
        with leaving.stream("POST", "/v1/chat/completions",
                            json=chat_body(PROMPT, LONG_TOKENS),
                            headers={"X-Request-Id": request_id}) as response:
            assert response.status_code == 200
            content_chunks = 0
            # Held in a name: a generator dropped at the break is closed at
            # once, and closing httpx's line iterator closes the response, so
            # the server could see the client leave before the check below.
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data:") and '"content"' in line \
                        and '"content":""' not in line:
                    content_chunks += 1
                    if content_chunks == 2:
                        break
            running = _state(app_server, request_id)
            assert running["live"] and running["num_running"] == 1, running
            assert running["usage"] > baseline["usage"], running
            # Leaving the blocks closes the response and the connection (TCP FIN).
        left = len(steps)  # read after the close: steps from here on follow it
        state = _wait_state(
            app_server, lambda s: (not s["live"] and s["num_running"] == baseline["num_running"]
                                   and s["usage"] <= baseline["usage"] and not s["held"]),
            "the request did not stop and free its blocks after the client left", request_id)
    assert state["usage"] == baseline["usage"], (state, baseline)
    carried = [i for i, st in enumerate(steps)
               if any(s.request_id == request_id for s in st.scheduled)]
    after_leaving = [i for i in carried if i >= left]
    assert len(carried) >= 2  # its prefill and the decodes of the two chunks read
    assert len(after_leaving) <= MAX_STEPS_AFTER_LEAVING, (
        f"{len(after_leaving)} steps still carried the request after its client left")
    print(f"steps that carried the request after its client left: {len(after_leaving)}")

    # The slot is free: the next request's first step is its own prefill, which
    # samples its first token (nothing of the departed request runs any more).
    with _recorded_steps(app_server) as steps:
        _short_stream(http)
    assert steps, "no step ran for the next request"
    assert all(s.request_id != request_id for st in steps for s in st.scheduled)
    first = steps[0].scheduled
    assert len(first) == 1 and first[0].is_new and first[0].sample, first
    engine = app_server.engine_thread.engine
    app_server.engine_thread.run(_check_consistency(engine))


async def _check_consistency(engine) -> None:
    engine.core.scheduler.kv_cache_manager.check_consistency()


@pytest.fixture
def timeout_1s(app_server):
    engine = app_server.engine_thread.engine
    engine.request_timeout = 1.0
    try:
        yield 1.0
    finally:
        engine.request_timeout = None


def test_request_timeout_non_streaming_504_and_blocks_freed(app_server, http, timeout_1s):
    baseline = _wait_state(app_server, _idle, "the engine did not go idle")
    response = http.post("/v1/chat/completions",
                         json=chat_body(PROMPT, LONG_TOKENS, stream=False),
                         headers={"X-Request-Id": "sched-timeout-plain"})
    assert response.status_code == 504, response.text
    error = assert_error_body(response.json(), 504)
    assert "--request-timeout" in error["message"], error
    state = _wait_state(app_server, lambda s: not s["live"] and _idle(s),
                        "blocks still held after the 504", "sched-timeout-plain")
    assert state["usage"] == baseline["usage"]


def test_request_timeout_streaming_error_event_and_blocks_freed(app_server, http, timeout_1s):
    _wait_state(app_server, _idle, "the engine did not go idle")
    http.headers["X-Request-Id"] = "sched-timeout-stream"
    try:
        result = post_stream(http, "/v1/chat/completions", chat_body(PROMPT, LONG_TOKENS))
    finally:
        del http.headers["X-Request-Id"]
    assert result.status == 200, result.body
    errors = [c["error"] for c in result.chunks if "error" in c]
    assert len(errors) == 1 and result.chunks[-1].get("error"), result.chunks[-3:]
    assert "--request-timeout" in errors[0]["message"], errors
    assert result.done
    # Cut short. (How many chunks came before the 1-s timeout depends on the
    # machine's load: none at all is a valid answer on a busy one.)
    assert len(result.choice_chunks()) < LONG_TOKENS
    state = _wait_state(app_server, lambda s: not s["live"] and _idle(s),
                        "blocks still held after the timeout", "sched-timeout-stream")
