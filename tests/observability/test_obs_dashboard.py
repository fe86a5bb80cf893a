"""Acceptance (issue 6): the Grafana dashboard is valid JSON and references
only metrics that ``/metrics`` exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvserve.observability.metrics import EngineMetrics, ServerMetrics, parse_metrics_text

DASHBOARD = Path(__file__).resolve().parents[2] / "tools" / "grafana_dashboard.json"


def _exprs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "query", "definition") and isinstance(value, str):
                yield value
            else:
                yield from _exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _exprs(item)


def test_dashboard_references_only_exposed_metrics():
    dashboard = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert dashboard["panels"]
    server = ServerMetrics()
    server.observe_http("/v1/completions", "POST", 429, 0.1)  # labelled series appear once used
    exposed = set(parse_metrics_text((EngineMetrics("m").render() + server.render()).decode()))
    referenced = {name for expr in _exprs(dashboard)
                  for name in re.findall(r"(?:kvserve:|http_|process_)[A-Za-z0-9_:]+", expr)}
    assert referenced, "the dashboard queries no kvserve metric"
    assert referenced <= exposed, sorted(referenced - exposed)
    # The panels: TTFT/ITL/E2E quantiles, phases, running/waiting, KV,
    # prefix hit rate, preemptions, throughput.
    for needed in ("time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                   "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_sum",
                   "request_prefill_time_seconds_sum", "request_decode_time_seconds_sum",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                   "prefix_cache_hits_total", "prefix_cache_queries_total",
                   "num_preemptions_total", "generation_tokens_total", "prompt_tokens_total"):
        assert f"kvserve:{needed}" in referenced, needed
    assert "http_requests_total" in referenced  # issue 25's refusal rate
