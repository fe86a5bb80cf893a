"""Acceptance (issue 25): ``/health`` reports a stalled engine.

A worker that takes longer than ``--stall-timeout`` over a step (fault
injection's ``step_delay_seconds`` stands in for a worker stuck in a
library call) makes ``/health`` answer 503 with the reason, the
``kvserve:engine_stall_seconds`` gauge climb and ``engine_stalled`` get
logged; once the request is done the engine is healthy again.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from engine_harness import DEFAULT_KV_MEMORY, EngineHandle, greedy

from kvserve.api import build_app
from kvserve.config import CacheConfig, EngineConfig, ServerConfig
from kvserve.observability.metrics import ServerMetrics, metrics_route, parse_metrics_text
from kvserve.testing.faults import FaultInjection

pytestmark = pytest.mark.model

STEP_DELAY = 2.0
STALL_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def slow_engine(engine_loop) -> EngineHandle:
    config = EngineConfig(model=engine_loop.model_path,
                          cache=CacheConfig(kv_cache_memory=DEFAULT_KV_MEMORY),
                          fault_injection=FaultInjection(step_delay_seconds=STEP_DELAY),
                          stall_timeout=STALL_TIMEOUT)
    handle = engine_loop.start(config)
    yield handle
    engine_loop.stop(handle)


@pytest.mark.slow
def test_health_is_503_while_no_step_finishes_and_200_after(slow_engine: EngineHandle) -> None:
    engine = slow_engine.engine
    app = build_app(engine, ServerConfig(),
                    extra_routes=[metrics_route(ServerMetrics(), engine.metrics)])

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as http:
            before = await http.get("/health")
            request = asyncio.create_task(slow_engine.agenerate(
                slow_engine.encode("Count to three."), greedy(2)))
            reading = await engine.check_health()
            while not reading.is_stalled:  # the first step sleeps STEP_DELAY s
                await asyncio.sleep(0.05)
                reading = await engine.check_health()
            during = await http.get("/health")
            metrics = parse_metrics_text((await http.get("/metrics")).text)
            result = await request
            after = await http.get("/health")
            return before, reading, during, metrics, result, after, await engine.check_health()

    before, reading, during, metrics, result, after, idle = slow_engine.run(go())
    assert before.status_code == 200 and before.json() == {"status": "ok"}
    assert reading.num_running + reading.num_waiting == 1
    assert during.status_code == 503, during.text
    message = during.json()["error"]["message"]
    assert message.startswith("The engine is stalled: no engine step finished for ")
    assert "--stall-timeout" in message and "1 request(s) ran" in message, message
    (_, stall), = metrics["kvserve:engine_stall_seconds"]
    assert stall >= STALL_TIMEOUT
    assert result.only.finish_reason == "length" and len(result.only.token_ids) == 2
    assert after.status_code == 200 and idle.stalled_seconds == 0.0
