"""Acceptance (issue 16, replicas and routing): ``kvserve serve
--data-parallel-size 2`` on a local Ray (no set-up) serves the golden
prompts with the outputs of one engine, and the same long prefix sent
repeatedly lands on one replica and reports ``cached_tokens``.

Both replicas run one CPU thread each; the reference is the shared
single-engine server of the e2e suite (two threads). A divergence is
accepted only at a near-tie of the top-2 logits (``first_divergence``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from e2e_support import GOLDEN, SERVER_MAX_MODEL_LEN, LiveServer, first_divergence

from kvserve.observability.metrics import parse_metrics_text

# slow: the module's shared engine or servers take most of its time (make test-slow).
pytestmark = [pytest.mark.model, pytest.mark.slow]

SYSTEM = ("You are a meticulous assistant for a library. Answer questions about books, "
          "authors and opening hours briefly, politely and only with facts you are sure of. "
          "If you do not know, say so in one sentence and suggest asking the front desk.")


@pytest.fixture(scope="module")
def dp_server(default_model_path, tmp_path_factory):
    """Two replicas on a local Ray, started where an earlier ``ray start``
    left its address behind with nothing listening there (issue 32): Ray's
    temp dir (``RAY_TMPDIR``, short: Ray's socket paths must stay under 107
    bytes) records ``127.0.0.1:<a closed port>``."""
    ray_tmp = Path(tempfile.mkdtemp(prefix="kr", dir="/tmp"))
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{_closed_port()}\n")
    saved = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = str(ray_tmp)
    try:
        server = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-dp"),
                            extra_args=["--max-model-len", str(SERVER_MAX_MODEL_LEN),
                                        "--data-parallel-size", "2", "--stats-interval", "0"])
    finally:
        if saved is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = saved
    yield server
    server.stop()
    shutil.rmtree(ray_tmp, ignore_errors=True)


def _closed_port() -> int:
    """A local TCP port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_stale_recorded_ray_cluster_gives_way_to_a_local_ray(dp_server):
    """The server became healthy (the fixture waited for it) on a local Ray,
    and said once why it did not join the recorded cluster."""
    gone = dp_server.log_events("ray_recorded_cluster_gone")
    assert len(gone) == 1 and gone[0]["address"].startswith("127.0.0.1:")
    started = dp_server.log_events("ray_started")
    assert len(started) == 1 and started[0]["address"] == "local"
    assert started[0]["seconds"] > 0


def greedy(case: dict) -> tuple[str, dict]:
    body = {"max_tokens": case["max_tokens"], "temperature": 0}
    if "messages" in case:
        return "/v1/chat/completions", {**body, "messages": case["messages"],
                                        "logprobs": True, "top_logprobs": 2}
    return "/v1/completions", {**body, "prompt": case["prompt"], "logprobs": 2}


def tokens_and_top2(choice: dict) -> tuple[list[str], list[list[float]]]:
    if "message" in choice:
        items = choice["logprobs"]["content"]
        return ([i["token"] for i in items],
                [[t["logprob"] for t in i["top_logprobs"]] for i in items])
    logprobs = choice["logprobs"]
    return logprobs["tokens"], [sorted(d.values(), reverse=True)
                                for d in logprobs["top_logprobs"]]


async def ask_all(base_url: str, cases: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        requests = [greedy(c) for c in cases]
        responses = await asyncio.gather(*(client.post(path, json=body)
                                           for path, body in requests))
    for response in responses:
        assert response.status_code == 200, response.text
    return [r.json()["choices"][0] for r in responses]


def assert_golden_as_one_engine(server: LiveServer, one_engine: LiveServer) -> list[dict]:
    """Every golden case sent at once to ``server`` gives ``one_engine``'s
    greedy output (a divergence only at a near-tie of the top-2 logits);
    returns the cases."""
    cases = [p.values[0]["case"] for p in GOLDEN if p.values[0] is not None]
    assert cases, "the golden cases are required"
    one = asyncio.run(ask_all(one_engine.base_url, cases))
    two = asyncio.run(ask_all(server.base_url, cases))
    for case, ref, got in zip(cases, one, two, strict=True):
        ref_tokens, ref_top2 = tokens_and_top2(ref)
        got_tokens, got_top2 = tokens_and_top2(got)
        top2 = [min(a, b, key=lambda t: t[0] - t[1]) for a, b in zip(got_top2, ref_top2)]
        if first_divergence(ref_tokens, got_tokens, top2, case.get("name", "case")) is None:
            assert ref.get("text", ref.get("message")) == got.get("text", got.get("message"))
    return cases


def test_two_replicas_serve_the_golden_prompts_as_one_engine(dp_server, live_server):
    assert_golden_as_one_engine(dp_server, live_server)  # concurrent: both replicas work
    routed = dp_server.log_events("request_routed")
    assert {e["replica"] for e in routed} == {0, 1}, "test precondition: both replicas served"


def test_a_repeated_long_prefix_lands_on_one_replica_and_hits_its_cache(dp_server):
    questions = ["Who wrote Emma?", "When do you open?", "Do you have Dune?",
                 "Who wrote Ulysses?"]
    cached, ids = [], []
    with httpx.Client(base_url=dp_server.base_url, timeout=300) as client:
        for i, question in enumerate(questions):
            rid = f"prefix-{i}"
            response = client.post("/v1/chat/completions", headers={"X-Request-Id": rid},
                                   json={"messages": [{"role": "system", "content": SYSTEM},
                                                      {"role": "user", "content": question}],
                                         "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            ids.append(rid)
    routed = {e["request_id"]: e for e in dp_server.log_events("request_routed")}
    replicas = {routed[rid]["replica"] for rid in ids}
    assert len(replicas) == 1, [routed[rid] for rid in ids]
    assert all(routed[rid]["reason"] == "prefix" for rid in ids[1:])
    assert cached[0] == 0 or cached[0] < cached[1]
    assert all(c >= 48 for c in cached[1:]), cached  # the system prompt's full blocks


def test_metrics_carry_a_replica_label(dp_server):
    text = httpx.get(f"{dp_server.base_url}/metrics", timeout=30).text
    assert 'kvserve:num_requests_running{replica="0"' in text
    assert 'kvserve:num_requests_running{replica="1"' in text


def replica_pids(server: LiveServer) -> dict[int, int]:
    """Each replica's latest pid (a restart logs the new one)."""
    events = server.log_events("replica_started") + server.log_events("replica_restarted")
    return {event["replica"]: event["pid"] for event in events}


async def wait_running(client: httpx.AsyncClient, at_least: int,
                       within: float = HANG_DEADLINE_S) -> None:
    """Until the replicas together run ``at_least`` requests (their gauges;
    ``within``: a hang deadline)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        samples = parse_metrics_text((await client.get("/metrics")).text)
        if sum(v for _, v in samples.get("kvserve:num_requests_running", [])) >= at_least:
            return
        assert loop.time() < deadline, hang_message(f"fewer than {at_least} requests ran",
                                                    within)
        await asyncio.sleep(0.05)


async def load_then_kill(server: LiveServer, pid: int) -> tuple[list, list, dict]:
    """12 non-streaming and 2 streaming requests; SIGKILL one replica while
    they run; then wait (with a deadline) for /health to be ok again."""
    import os
    import signal

    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
        async def plain(i):
            r = await client.post("/v1/completions", json={
                "prompt": f"Story {i}: once upon a time", "max_tokens": 40, "temperature": 0,
                "ignore_eos": True})
            return r.status_code, r.json()

        async def streamed(i):
            lines = []
            async with client.stream("POST", "/v1/completions", json={
                    "prompt": f"Tale {i}: long ago", "max_tokens": 40, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as r:
                async for line in r.aiter_lines():
                    lines.append(line)
            return lines

        plains = [asyncio.create_task(plain(i)) for i in range(12)]
        streams = [asyncio.create_task(streamed(i)) for i in range(2)]
        await wait_running(client, at_least=4)  # both replicas mid-step
        os.kill(pid, signal.SIGKILL)
        plain_results = await asyncio.gather(*plains)
        stream_results = await asyncio.gather(*streams)
        loop = asyncio.get_running_loop()
        deadline, health = loop.time() + HANG_DEADLINE_S, {}  # a hang deadline
        while loop.time() < deadline:
            response = await client.get("/health")
            health = response.json()
            if response.status_code == 200 and health.get("status") == "ok":
                break
            await asyncio.sleep(0.2)
    return plain_results, stream_results, health


def test_a_killed_replica_loses_no_unstreamed_request_and_comes_back(dp_server):
    pids = replica_pids(dp_server)
    plain, streamed, health = asyncio.run(load_then_kill(dp_server, pids[0]))
    for status, body in plain:  # nothing was sent to these clients: retried, complete
        assert status == 200 and body["usage"]["completion_tokens"] == 40, body
    for lines in streamed:  # complete, or ended with an error event: never hung
        assert lines[-2:] == ["data: [DONE]", ""] or "data: [DONE]" in lines, lines[-3:]
    assert health == {"status": "ok"}, (health, os.getloadavg())
    assert replica_pids(dp_server)[0] != pids[0], "test precondition: the replica restarted"


def test_zz_sigterm_drains_a_data_parallel_server(dp_server):
    """Issue 47, item 7 (last in the module: it stops the shared server):
    ``ray.init`` had replaced the drain handler, so SIGTERM killed a
    data-parallel server within 0.1 s. Now a stream open at the signal runs
    to its ``max_tokens`` (a drain, not a cut) and the server exits 0."""
    body = {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=dp_server.base_url, timeout=HANG_DEADLINE_S) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    break
            dp_server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
    assert any('"finish_reason":"length"' in line.replace(" ", "") for line in rest), rest[-3:]
    assert "data: [DONE]" in rest
    try:
        status = dp_server.proc.wait(timeout=HANG_DEADLINE_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(hang_message("the server did not exit", HANG_DEADLINE_S)) from None
    assert status == 0, dp_server.log_tail()
    assert dp_server.log_events("sigterm_received")
