"""Acceptance (issue 32, model parallelism): ``kvserve serve`` with
``--pipeline-parallel-size 2``, ``--tensor-parallel-size 2`` (the default
model's 3 KV heads split 1 + 2 over the two workers) and both (four
workers) on a local Ray serves the golden prompts with the outputs of one
process; a stage's process killed mid-stream restarts the requests in
flight from their prompts (issue 47 item 8: no 500), ``/health`` answers
503 ``unavailable`` while Ray restarts it, and the same server serves
again.

Every worker runs one CPU thread (on the 2-core machine: -pp 2 and -tp 2
one core each, -tp 2 -pp 2 four workers on two cores); the reference is
the e2e suite's shared one-process server. A divergence is accepted only at
a near-tie of the top-2 logits (``first_divergence``), as for data
parallelism: tensor parallelism sums each layer's products in another
order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from deadlines import HANG_DEADLINE_S
from e2e_support import SERVER_MAX_MODEL_LEN, LiveServer
from test_e2e_data_parallel import assert_golden_as_one_engine

from kvserve.observability.metrics import parse_metrics_text

# slow: the module's shared engine or servers take most of its time (make test-slow).
pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def pp_server(default_model_path, tmp_path_factory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-pp"),
                        extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN),
                                    "--pipeline-parallel-size", "2", "--num-threads", "1",
                                    "--stats-interval", "0"])
    yield server
    server.stop()


def test_two_stages_serve_the_golden_prompts_as_one_process(pp_server, live_server):
    assert_golden_as_one_engine(pp_server, live_server)


@pytest.mark.parametrize("layout", [("2", "1"), ("2", "2")], ids=["tp2", "tp2-pp2"])
def test_tensor_parallel_workers_serve_the_golden_prompts_as_one_process(
        layout, default_model_path, tmp_path_factory, live_server):
    tp, pp = layout
    server = LiveServer(default_model_path, tmp_path_factory.mktemp(f"kvserve-tp{tp}-pp{pp}"),
                        extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN),
                                    "--tensor-parallel-size", tp, "--pipeline-parallel-size", pp,
                                    "--num-threads", "1", "--stats-interval", "0"])
    try:
        workers = server.log_events("pipeline_stage")
        # 9 query / 3 KV heads over 2 workers: rank 0 holds 3 / 1, rank 1 6 / 2
        heads = sorted({(e["tp_rank"], e["q_heads"], e["kv_heads"]) for e in workers})
        assert heads == [(0, 3, 1), (1, 6, 2)]
        assert len(workers) == int(tp) * int(pp)
        assert_golden_as_one_engine(server, live_server)
    finally:
        server.stop()


def test_start_up_lines_show_each_stage_and_its_layers(pp_server):
    stages = sorted(pp_server.log_events("pipeline_stage"), key=lambda e: e["stage"])
    assert [(e["stage"], e["layers"]) for e in stages] == [(0, [0, 15]), (1, [15, 30])]
    assert stages[0]["pid"] != stages[1]["pid"] != os.getpid()
    # the same KV buffers' size in each stage: 15 layers of the engine's blocks
    assert stages[0]["kv_bytes"] == stages[1]["kv_bytes"] > 0
    (config,) = pp_server.log_events("pipeline_config")
    assert config["pipeline_parallel_size"] == 2 and config["num_threads"] == 1


def test_metrics_time_each_stage(pp_server):
    with httpx.Client(base_url=pp_server.base_url, timeout=300) as client:
        response = client.post("/v1/completions", json={"prompt": "Count: one, two,",
                                                        "max_tokens": 8, "temperature": 0})
        assert response.status_code == 200, response.text
        samples = parse_metrics_text(client.get("/metrics").text)
    busy = {labels["stage"]: value
            for labels, value in samples["kvserve:pipeline_stage_busy_seconds_total"]}
    counts = {labels["stage"]: value
              for labels, value in samples["kvserve:pipeline_stage_seconds_count"]}
    assert set(busy) == set(counts) == {"0", "1"}
    assert counts["0"] == counts["1"] >= 8  # every step went through both stages
    assert busy["0"] > 0 and busy["1"] > 0


def _stream_then_kill(server: LiveServer, pid: int) -> tuple[list[dict], list[str]]:
    """A long greedy stream; once 5 tokens arrived, SIGKILL the stage's
    process; meanwhile /health every 50 ms. Returns the stream's events and
    the health statuses seen (until 20 s after the stream ended)."""
    async def run():
        statuses: list[str] = []
        events: list[dict] = []
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            async def watch(until: asyncio.Event):
                while not until.is_set():
                    r = await client.get("/health")
                    statuses.append(r.json().get("status", str(r.status_code))
                                    if r.status_code == 200 else f"http {r.status_code}")
                    await asyncio.sleep(0.05)

            stop = asyncio.Event()
            watcher = None
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": "Tell a long tale of a lighthouse keeper", "max_tokens": 400,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 5:
                        os.kill(pid, signal.SIGKILL)
                        watcher = asyncio.create_task(watch(stop))
            deadline = time.monotonic() + HANG_DEADLINE_S  # a hang deadline
            while time.monotonic() < deadline and (not statuses or statuses[-1] != "ok"
                                                   or "http 503" not in statuses):
                await asyncio.sleep(0.1)
            stop.set()
            if watcher is not None:
                await watcher
        return events, statuses

    return asyncio.run(run())


def test_a_killed_stage_restarts_its_requests_and_the_server_serves_again(pp_server):
    """Last in the module: it kills stage 1's process. The stream in flight
    pauses and ends whole (its request started again from its prompt once
    Ray restarted the stage); ``/health`` said 503 meanwhile."""
    (stage,) = [e for e in pp_server.log_events("pipeline_stage") if e["stage"] == 1]
    events, statuses = _stream_then_kill(pp_server, stage["pid"])
    assert not [e for e in events if "error" in e], events[-3:]
    tokens = [e for e in events if e.get("choices")]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 400
    assert "http 503" in statuses and statuses[-1] == "ok", (statuses, os.getloadavg())
    assert "degraded" not in statuses  # a pipeline with a stage down cannot compute at all
    restarted = pp_server.log_events("pipeline_stage_restarted")
    assert [e["stage"] for e in restarted] == [1] and restarted[0]["pid"] != stage["pid"]
    pp_server.assert_alive()  # the server itself never restarted
    with httpx.Client(base_url=pp_server.base_url, timeout=300) as client:
        response = client.post("/v1/completions", json={"prompt": "The capital of France is",
                                                        "max_tokens": 6, "temperature": 0})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 6
    preempted = [e for e in pp_server.log_events("request_preempted")
                 if e.get("reason") == "kv_cache_lost"]
    assert preempted and "KVCacheLost" in preempted[0]["error"]
    assert not [e for e in pp_server.log_events("step_failed") if "request_ids" in e]
    assert pp_server.log_events("kv_cache_lost")  # the prefix cache forgotten
