"""Acceptance (issue 6) against a live ``kvserve serve``: ``GET /metrics``
after N streamed requests, and the lifecycle log events of each request."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from e2e_support import LiveServer, iter_sse_data

from kvserve.observability.metrics import METRICS, exposed_series, parse_metrics_text

pytestmark = pytest.mark.model

N = 4
CLASS = "acceptance-test"
LIFECYCLE = ["request_received", "request_queued", "request_scheduled", "request_first_token",
             "request_finished"]
PROMPT = ("Summarise in a few words why continuous batching helps an inference server keep "
          "its accelerator busy when many clients stream tokens at the same time. ") * 3


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    live = LiveServer(default_model_path, tmp_path_factory.mktemp("kvserve-obs"),
                      extra_args=["--max-model-len", "512", "--stats-interval", "1",
                                  "--log-level", "debug"])  # per-request lines are debug
    yield live
    live.stop()


def scrape(base_url: str) -> dict:
    response = httpx.get(f"{base_url}/metrics", timeout=HANG_DEADLINE_S)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return parse_metrics_text(response.text)


def value(samples: dict, name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, ())
               if all(lab.get(k) == want for k, want in labels.items()))


def stream_one(client: httpx.Client, request_id: str) -> float:
    """One streamed completion; the client-side TTFT (monotonic seconds from
    sending to the first chunk that carries a choice)."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 12,
            "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": request_id, "X-Request-Class": CLASS}
    start = time.monotonic()
    ttft = None
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        for payload in iter_sse_data(response.iter_lines()):
            if payload == "[DONE]":
                break
            chunk = json.loads(payload)
            if ttft is None and chunk.get("choices"):
                ttft = time.monotonic() - start
    assert ttft is not None
    return ttft


def wait_idle(base_url: str, timeout: float = HANG_DEADLINE_S) -> dict:
    """The metrics once no request runs or waits (``timeout``: a hang deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(base_url)
        idle = (value(samples, "kvserve:num_requests_running") == 0
                and value(samples, "kvserve:num_requests_waiting") == 0)
        if idle:
            return samples
        assert time.monotonic() < deadline, hang_message("the server did not go idle", timeout)
        time.sleep(0.1)


@pytest.fixture(scope="module")
def run(server: LiveServer):
    """N streamed requests, one at a time, between two scrapes."""
    before = wait_idle(server.base_url)
    ids = [f"obs-{i}-{time.monotonic_ns()}" for i in range(N)]
    with httpx.Client(base_url=server.base_url, timeout=HANG_DEADLINE_S) as client:
        client_ttfts = [stream_one(client, rid) for rid in ids]
    after = wait_idle(server.base_url)
    wait_for_stats_line(server)
    return before, after, ids, client_ttfts


def wait_for_stats_line(server: LiveServer, timeout: float = HANG_DEADLINE_S) -> None:
    """Until an ``engine_stats`` line follows the last ``request_finished``
    in the server's log (one stats interval later), or the (hang) deadline."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = [e.get("event") for e in _events(server)]
        last_finished = max((i for i, n in enumerate(names) if n == "request_finished"),
                            default=-1)
        if "engine_stats" in names[last_finished + 1:]:
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_metrics_after_streamed_requests(server, run):
    before, after, ids, client_ttfts = run

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("kvserve:time_to_first_token_seconds_count") == N
    server_ttft = delta("kvserve:time_to_first_token_seconds_sum")
    client_ttft = sum(client_ttfts)
    # The histogram holds the requests' own TTFTs (each logged, from arrival:
    # queue + prefill), no wall-clock ratio to the client's (issue 33).
    finished = {e["request_id"]: e for e in _events(server)
                if e.get("event") == "request_finished" and e.get("request_id") in ids}
    logged = [finished[rid]["ttft_s"] for rid in ids]
    assert server_ttft == pytest.approx(sum(logged), abs=1e-4 * N), (server_ttft, logged)
    assert all(finished[rid]["prefill_s"] > 0 for rid in ids), finished
    assert server_ttft <= client_ttft  # the client's TTFT includes HTTP on top
    assert delta("kvserve:request_time_per_output_token_seconds_sum") > 0
    assert delta("kvserve:request_time_per_output_token_seconds_count") == N
    assert delta("kvserve:inter_token_latency_seconds_sum") > 0
    assert delta("kvserve:inter_token_latency_seconds_count") >= N * 10  # 11 gaps each
    assert delta("kvserve:e2e_request_latency_seconds_count") == N
    assert delta("kvserve:request_success_total", finished_reason="length") == N
    assert delta("kvserve:generation_tokens_total") == N * 12
    assert delta("kvserve:request_generation_tokens_sum") == N * 12
    assert delta("kvserve:prompt_tokens_total") > 0
    for phase in ("queue", "prefill", "decode", "inference"):
        assert delta(f"kvserve:request_{phase}_time_seconds_count") == N
    e2e = delta("kvserve:e2e_request_latency_seconds_sum")
    parts = sum(delta(f"kvserve:request_{p}_time_seconds_sum")
                for p in ("queue", "prefill", "decode"))
    assert parts == pytest.approx(e2e, abs=0.005 * N)
    assert value(after, "kvserve:prefix_cache_hits_total") <= \
        value(after, "kvserve:prefix_cache_queries_total")
    assert value(after, "kvserve:prefix_cache_hits_total") > 0  # same prompt N times
    assert value(after, "kvserve:num_requests_running") == 0
    assert value(after, "kvserve:num_requests_waiting") == 0
    assert 0 <= value(after, "kvserve:kv_cache_usage_perc") <= 1
    # No metric missing or misnamed, all with the model_name label.
    for name in METRICS:
        for series in exposed_series(name):
            assert series in after, f"{series} missing from /metrics"
    for name, rows in after.items():
        if name.startswith("kvserve:"):
            assert all(lab.get("model_name") == "SmolLM2-135M-Instruct" for lab, _ in rows), name


def test_http_and_process_metrics(server, run):
    """Issue 25: the N completions in ``http_requests_total`` (the scrapes
    and health probes are not counted), and the process collector's series."""
    before, after, _, _ = run
    labels = {"handler": "/v1/completions", "method": "POST", "status": "2xx"}
    assert value(after, "http_requests_total", **labels) - \
        value(before, "http_requests_total", **labels) == N
    assert value(after, "http_requests_total", handler="/metrics") == 0
    assert value(after, "process_resident_memory_bytes") > 0
    assert value(after, "process_open_fds") > 0


def test_every_log_line_is_json(server, run):
    """Issue 25: under --log-format json uvicorn's lines are JSON too."""
    lines = server.stderr_path.read_text(encoding="utf-8").splitlines()
    events = [json.loads(line) for line in lines]  # fails on any line that is not JSON
    assert all({"event", "level", "timestamp"} <= set(e) for e in events)
    uvicorn = [e["event"] for e in events if e.get("logger") == "uvicorn.error"]
    assert "Application startup complete." in uvicorn, uvicorn
    listening = [e for e in events if e["event"] == "server_listening"]
    assert len(listening) == 1 and listening[0]["url"].startswith("http://127.0.0.1:"), listening


def _events(server: LiveServer) -> list[dict]:
    events = []
    for line in server.stderr_path.read_text(encoding="utf-8", errors="replace").splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


def test_lifecycle_events_in_order_with_consistent_timings(server, run):
    _, _, ids, client_ttfts = run
    events = _events(server)
    for rid, client_ttft in zip(ids, client_ttfts):
        mine = [e for e in events if e.get("request_id") == rid]
        names = [e["event"] for e in mine if e["event"] in LIFECYCLE]
        assert names == LIFECYCLE, names
        finished = next(e for e in mine if e["event"] == "request_finished")
        parts = finished["queue_s"] + finished["prefill_s"] + finished["decode_s"]
        assert parts == pytest.approx(finished["e2e_s"], abs=0.003)
        assert finished["queue_s"] + finished["prefill_s"] == \
            pytest.approx(finished["ttft_s"], abs=0.003)
        assert finished["inference_s"] == \
            pytest.approx(finished["prefill_s"] + finished["decode_s"], abs=0.003)
        assert finished["tpot_s"] == pytest.approx(finished["decode_s"] / 11, rel=0.01)
        assert finished["ttft_s"] <= client_ttft
        assert finished["request_class"] == CLASS
        assert finished["finish_reason"] == "length" and finished["output_tokens"] == 12
        assert finished["prompt_tokens"] > 50 and finished["priority"] == 0
        received = next(e for e in mine if e["event"] == "request_received")
        assert abs(received["arrival_time"] - finished["arrival_time"]) < 0.01
        assert abs(finished["arrival_time"] - time.time()) < 3600  # wall clock, epoch seconds
        first = next(e for e in mine if e["event"] == "request_first_token")
        assert first["ttft_s"] == pytest.approx(finished["ttft_s"], abs=1e-5)
        assert "prompt" not in received  # only with --log-prompts
    stats = [e for e in events if e.get("event") == "engine_stats"]
    assert stats, "no engine_stats line with --stats-interval 1"
    assert "Avg prompt throughput" in stats[-1]["message"]
    assert {"prompt_throughput", "generation_throughput", "num_running", "num_waiting",
            "preemptions", "kv_cache_usage", "prefix_cache_hit_rate"} <= set(stats[-1])
    assert PROMPT[:40] not in server.stderr_path.read_text(encoding="utf-8")


def test_diagnose_command_on_an_idle_server(server, run, capsys):
    from kvserve.cli import main

    assert main(["diagnose", "--url", server.base_url, "--interval", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bottleneck"] is None and report["verdicts"] == []
    assert report["features"]["source"] == "metrics"


#: Issue 47, item 6: constraints whose refusal quotes the user's own text.
SECRET = "SECRETconstraint47"
REFUSED_CONSTRAINTS = [
    {"structured_outputs": {"regex": f"({SECRET}"}},
    {"structured_outputs": {"grammar": f"start: {SECRET} ("}},
    {"response_format": {"type": "json_schema",
                         "json_schema": {"name": "n", "schema": {"type": SECRET}}}},
    {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object",
                                    "properties": {"a": {"type": SECRET}}}}}]},
]


def test_refused_constraints_are_not_quoted_in_the_log(server):
    """Without --log-prompts no log line holds a refused regex, grammar or
    schema (the compiler's detail quotes them; the client's 400 keeps it)."""
    for fields in REFUSED_CONSTRAINTS:
        r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=HANG_DEADLINE_S,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                             **fields})
        assert r.status_code == 400 and SECRET in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + HANG_DEADLINE_S
    while not server.log_events("http_refused") and time.monotonic() < deadline:
        time.sleep(0.1)
    refused = server.log_events("constraint_refused")
    assert refused and all("reason_chars" in e for e in refused)
    assert SECRET not in server.stderr_path.read_text(encoding="utf-8")


#: Every series vLLM's published Grafana dashboard queries
#: (vllm-project/vllm, examples/online_serving/prometheus_grafana/grafana.json:
#: each panel's ``expr``, each selecting ``{model_name="$model_name"}``).
VLLM_DASHBOARD_SERIES = (
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_sum", "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
)


def test_vllms_grafana_dashboard_reads_kvserve_with_vllm_names(server):
    """Issue 48, item 4: with ``--metric-names vllm`` (the route's
    ``with_metric_names`` on this live server's scrape) every series the
    dashboard queries exists for the served model, after a request."""
    from kvserve.observability.metrics import with_metric_names

    r = httpx.post(f"{server.base_url}/v1/completions", timeout=HANG_DEADLINE_S,
                   json={"prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200
    model = r.json()["model"]
    text = httpx.get(f"{server.base_url}/metrics", timeout=HANG_DEADLINE_S).content
    renamed = parse_metrics_text(with_metric_names(text, "vllm").decode())
    missing = [name for name in VLLM_DASHBOARD_SERIES
               if not any(labels.get("model_name") == model for labels, _ in renamed.get(name, ()))]
    assert missing == []
    assert {labels["finished_reason"] for labels, _ in renamed["vllm:request_success_total"]} \
        >= {"length"}
    assert not [name for name in renamed if name.startswith("kvserve:")]
    both = parse_metrics_text(with_metric_names(text, "both").decode())
    assert "kvserve:num_requests_running" in both and "vllm:num_requests_running" in both
