"""HTTP and process metrics in ``/metrics`` (issue 25): requests counted by
route template, method and status group (prometheus-fastapi-instrumentator's
names), errors by exact status, and the process collector's series."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine

from kvserve.api import build_app
from kvserve.api.http_metrics import HttpMetricsMiddleware, instrument
from kvserve.config import ServerConfig
from kvserve.observability.metrics import EngineMetrics, ServerMetrics, metrics_route, parse_metrics_text

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client():
    server = ServerMetrics()
    app = instrument(build_app(FakeEngine(), ServerConfig(), extra_routes=[
        metrics_route(server, EngineMetrics("fake-model"))]), server)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as c:
        yield c


def by_labels(samples: dict, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    return {tuple(labels[k] for k in keys): value for labels, value in samples.get(name, [])}


async def test_requests_are_counted_by_template_method_and_status_group(client) -> None:
    assert (await client.get("/v1/models")).status_code == 200
    assert (await client.post("/v1/completions", content=b"{not json")).status_code == 400
    assert (await client.get("/v1/no-such-route")).status_code == 404
    assert (await client.get("/client/chosen/path")).status_code == 404
    assert (await client.request("BREW", "/v1/models")).status_code == 405
    assert (await client.get("/health")).status_code == 200  # a probe: not counted

    response = await client.get("/metrics")
    assert response.status_code == 200
    samples = parse_metrics_text(response.text)
    assert by_labels(samples, "http_requests_total", "handler", "method", "status") == {
        ("/v1/models", "GET", "2xx"): 1,
        ("/v1/completions", "POST", "4xx"): 1,
        ("none", "GET", "4xx"): 2,
        ("/v1/models", "other", "4xx"): 1,
    }
    assert by_labels(samples, "http_request_duration_seconds_count", "handler", "method") == {
        ("/v1/models", "GET"): 1, ("/v1/completions", "POST"): 1, ("none", "GET"): 2,
        ("/v1/models", "other"): 1}
    assert by_labels(samples, "kvserve:http_error_responses_total", "status") == {
        ("400",): 1, ("404",): 2, ("405",): 1}
    # the engine's metrics are still there, and the process's
    assert "kvserve:num_requests_running" in samples
    assert samples["process_resident_memory_bytes"][0][1] > 0
    assert samples["process_open_fds"][0][1] > 0
    assert "process_cpu_seconds_total" in samples


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, int]] = []

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None:
        assert seconds >= 0
        self.seen.append((handler, method, status))


async def call(app, recorder: Recorder, method: str = "POST") -> None:
    """One request through the middleware around ``app`` (no routes: ``none``)."""
    messages = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        messages.append(message)

    scope = {"type": "http", "method": method, "path": "/x", "headers": [],
             "query_string": b"", "root_path": ""}
    await HttpMetricsMiddleware(app, recorder, routes=[])(scope, receive, send)


async def test_a_response_that_never_starts_counts_as_500() -> None:
    recorder = Recorder()

    async def raises(scope, receive, send):
        raise RuntimeError("boom")

    async def answers_nothing(scope, receive, send):
        return None

    with pytest.raises(RuntimeError):
        await call(raises, recorder)
    await call(answers_nothing, recorder, method="GET")
    assert recorder.seen == [("none", "POST", 500), ("none", "GET", 500)]


async def test_a_client_gone_counts_with_the_status_the_app_gave() -> None:
    recorder = Recorder()

    async def client_closed(scope, receive, send):
        await send({"type": "http.response.start", "status": 499, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    await call(client_closed, recorder)
    assert recorder.seen == [("none", "POST", 499)]
