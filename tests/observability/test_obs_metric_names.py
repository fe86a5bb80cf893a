"""``--metric-names`` (``kvserve.observability.metrics.with_metric_names``):
kvserve's series under vLLM's ``vllm:`` prefix, with the old
``gpu_cache_usage_perc`` name vLLM's dashboard reads, or both prefixes;
served by the ``/metrics`` route."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette

from kvserve.observability.metrics import (ServerMetrics, metrics_route, parse_metrics_text,
                                           with_metric_names)

TEXT = (b"# HELP kvserve:kv_cache_usage_perc KV-cache usage.\n"
        b"# TYPE kvserve:kv_cache_usage_perc gauge\n"
        b'kvserve:kv_cache_usage_perc{model_name="m"} 0.25\n'
        b"# HELP kvserve:num_requests_running Running.\n"
        b"# TYPE kvserve:num_requests_running gauge\n"
        b'kvserve:num_requests_running{model_name="m"} 3.0\n')


def test_vllm_names_and_the_dashboards_alias():
    samples = parse_metrics_text(with_metric_names(TEXT, "vllm").decode())
    assert samples["vllm:kv_cache_usage_perc"] == [({"model_name": "m"}, 0.25)]
    assert samples["vllm:gpu_cache_usage_perc"] == [({"model_name": "m"}, 0.25)]
    assert samples["vllm:num_requests_running"] == [({"model_name": "m"}, 3.0)]
    assert not [name for name in samples if name.startswith("kvserve:")]
    assert with_metric_names(TEXT, "kvserve") == TEXT
    both = parse_metrics_text(with_metric_names(TEXT, "both").decode())
    assert {"kvserve:num_requests_running", "vllm:num_requests_running"} <= set(both)


@pytest.mark.anyio
@pytest.mark.parametrize("names, present, absent", [
    ("vllm", "vllm:num_requests_running", "kvserve:num_requests_running"),
    ("kvserve", "kvserve:num_requests_running", "vllm:num_requests_running")])
async def test_the_route_serves_the_chosen_names(names, present, absent):
    async def engine_text() -> str:
        return TEXT.decode()

    app = Starlette(routes=[metrics_route(ServerMetrics(), engine_text, names)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        text = (await client.get("/metrics")).text
    assert present in text and absent not in text


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
