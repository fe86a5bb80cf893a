"""Acceptance (issue 14, fault injection): the engine survives its own failures.

- Faults in 1 of every 10 steps over 50 requests: the requests of the
  faulted steps get an error event, every other request completes with the
  output of a fault-free run, and no KV block leaks.
- An actor that dies fails every open request at once (none hangs), new
  requests get 503 and ``/health`` answers 503 with the reason.

``kvserve.testing.faults`` injects the faults; the reference outputs come from the
shared fault-free engine of the e2e suite.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import EngineThread, collect, first_divergence, make_request, \
    wait_all_blocks_free

from kvserve.api import build_app
from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from kvserve.testing.faults import FaultInjection, FaultyRunner

pytestmark = pytest.mark.model

NUM_REQUESTS = 50
STEP_EVERY = 10
MAX_TOKENS = 6
STARTS = ["The quick brown fox", "def add(a, b):\n", "Once upon a time,", "1, 1, 2, 3, 5,",
          "The three laws of", "import numpy as np\n", "Monday, Tuesday,", "Water boils at",
          "My favourite colour is", "In 1969, the first"]


def requests(tag: str):
    """50 distinct greedy completions (distinct first tokens, so no prefix
    hit ties one request's fate to another's)."""
    return [make_request(f"{tag}-{i}", prompt=f"{STARTS[i % len(STARTS)]} ({i})",
                         max_tokens=MAX_TOKENS, logprobs=2) for i in range(NUM_REQUESTS)]


def engine_config(model: Path, faults: FaultInjection | None) -> EngineConfig:
    """A small step budget (16 tokens, 8 sequences): 50 requests take about
    80 steps, so one in ten faults about 8 times."""
    return EngineConfig(model=str(model), cache=CacheConfig(kv_cache_memory=256 * 1024**2),
                        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                        logprobs_mode="raw_logits", fault_injection=faults)


async def run_all(engine, tag: str):
    return await asyncio.gather(*(collect(engine, r) for r in requests(tag)))


@pytest.fixture
def faulty_engine(default_model_path: Path):
    """Stopped with its one test, not kept beside the next tests' engines."""
    handle = EngineThread(engine_config(default_model_path, FaultInjection(step_every=STEP_EVERY)))
    yield handle
    handle.close()


@pytest.mark.slow
def test_faults_in_one_step_of_ten_fail_only_their_requests(e2e_engine, faulty_engine) -> None:
    reference = {g.request_id.split("-")[1]: g for g in e2e_engine.run(run_all(e2e_engine.engine,
                                                                                "ref"))}
    results = faulty_engine.run(run_all(faulty_engine.engine, "faulty"))
    runner = faulty_engine.engine.worker.runner
    assert isinstance(runner, FaultyRunner)
    faulted_ids = {rid for _, ids in runner.faulted for rid in ids}
    failed = [g for g in results if g.failed is not None]
    assert len(runner.faulted) >= 3 and failed, "test precondition: steps should have faulted"
    for got in failed:
        assert got.request_id in faulted_ids, f"{got.request_id} failed outside a faulted step"
        assert got.failed.status == 500 and "fault injected" in got.failed.message, got.failed
        assert got.failed.type == "server_error"
    for got in results:
        if got.failed is not None:
            continue
        ref = reference[got.request_id.split("-")[1]]
        assert ref.failed is None
        top2 = [min(a, b, key=lambda t: t[0] - t[1]) for a, b in zip(got.top2(), ref.top2())]
        if first_divergence(ref.token_ids, got.token_ids, top2, got.request_id) is None:
            assert got.text == ref.text and got.finish_reason == ref.finish_reason
    snap = faulty_engine.run(wait_all_blocks_free(faulty_engine.engine))
    assert snap.all_free, snap
    # and the engine serves the next request
    after = faulty_engine.generate(make_request("after", prompt="Water boils at", max_tokens=2))
    assert after.failed is None or "fault injected" in after.failed.message


@pytest.mark.parametrize("actor", ["scheduler", "detokenizer", "worker"])
@pytest.mark.slow
def test_an_actor_that_dies_fails_open_requests_and_health(default_model_path: Path,
                                                           actor: str) -> None:
    handle = EngineThread(engine_config(
        default_model_path, FaultInjection(kill_actor=actor, kill_after_messages=2)))
    try:
        engine = handle.engine
        first = handle.generate(make_request("victim", prompt="Once upon a time,",
                                             max_tokens=20), timeout=HANG_DEADLINE_S)
        assert first.failed is not None and first.failed.status == 500, first
        assert f"the {actor} actor died" in first.failed.message
        assert not engine.is_ready() and actor in engine.dead_reason
        late = handle.generate(make_request("late", prompt="Hello", max_tokens=2))
        assert late.failed is not None and late.failed.status == 503
        health = handle.run(_get_health(engine))
        assert health.status_code == 503
        assert f"the {actor} actor died" in health.json()["error"]["message"]
    finally:
        handle.close()


async def _get_health(engine) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(engine, ServerConfig()))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        return await client.get("/health")
