"""Bad input, engine refusals, routing errors and auth: OpenAI error objects."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import FakeEngine, failing

from kvserve.api import build_app
from kvserve.config import ServerConfig

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]}


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    return error


async def test_malformed_json(client, engine):
    r = await client.post("/v1/chat/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert assert_error(r, 400)["type"] == "invalid_request_error"
    assert engine.requests == []


async def test_body_not_an_object(client):
    r = await client.post("/v1/chat/completions", json=[1, 2])
    assert_error(r, 400)


async def test_wrong_content_type(client):
    r = await client.post("/v1/chat/completions", content=b"a=b",
                          headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(r, 415)


@pytest.mark.parametrize("payload, param", [
    ({"model": "fake-model"}, "messages"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "messages": "hi"}, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages.0.content.0.type"),
    ({**CHAT, "max_tokens": "10"}, "max_tokens"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "stream": "yes"}, "stream"),
    ({**CHAT, "n": 1.5}, "n"),
    ({**CHAT, "stop": [1]}, "stop.0"),
    ({**CHAT, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
])
async def test_chat_validation_errors(client, payload, param):
    r = await client.post("/v1/chat/completions", json=payload)
    error = assert_error(r, 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("payload, param", [
    ({**CHAT, "temperature": -0.1}, "temperature"),
    ({**CHAT, "top_p": 1.5}, "top_p"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({**CHAT, "n": 0}, "n"),
    ({**CHAT, "presence_penalty": 3}, "presence_penalty"),
    ({**CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
])
async def test_sampling_range_errors(client, engine, payload, param):
    r = await client.post("/v1/chat/completions", json=payload)
    assert_error(r, 400, param)
    assert engine.requests == []


@pytest.mark.parametrize("payload, param", [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
])
async def test_completion_validation_errors(client, payload, param):
    r = await client.post("/v1/completions", json=payload)
    assert_error(r, 400, param)


async def test_unknown_model_is_404(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert assert_error(r, 404, "model")["code"] == "model_not_found"
    assert engine.requests == []


async def test_oversized_body_is_413(client):
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert_error(await client.post("/v1/chat/completions", json=big), 413)


async def test_oversized_body_without_content_length(client):
    async def chunks():
        for _ in range(10):
            yield b" " * 1000
    r = await client.post("/v1/chat/completions", content=chunks(),
                          headers={"content-type": "application/json"})
    assert_error(r, 413)


async def test_unknown_route_and_wrong_method(client):
    error = assert_error(await client.get("/v1/nothing"), 404)
    assert "/v1/nothing" in error["message"]
    r = await client.get("/v1/chat/completions")
    assert_error(r, 405)
    assert "POST" in r.headers["allow"]


async def test_bad_priority_header(client, engine):
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Priority": "high"})
    assert_error(r, 400, "X-Priority")
    assert engine.requests == []


async def test_429_from_engine_has_retry_after(client, engine):
    engine.script = failing(429, "Too many requests waiting", type="rate_limit_error",
                            code="overloaded", retry_after=2.5)
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    error = assert_error(r, 429)
    assert error["type"] == "rate_limit_error" and error["code"] == "overloaded"
    assert r.headers["retry-after"] == "3"
    assert engine.aborted == []


async def test_engine_refusal_keeps_status_and_param(client, engine):
    engine.script = failing(400, "prompt is too long", param="messages")
    assert_error(await client.post("/v1/chat/completions", json=CHAT), 400, "messages")
    engine.script = failing(503, "draining", type="service_unavailable")
    assert_error(await client.post("/v1/completions", json={"prompt": "x"}), 503)


async def test_engine_serves_after_bad_requests(client):
    await client.post("/v1/chat/completions", content=b"{")
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


@pytest.fixture
def auth_client_factory():
    def make(engine: FakeEngine) -> httpx.AsyncClient:
        app = build_app(engine, ServerConfig(api_key="sekret"))
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return make


async def test_auth(auth_client_factory):
    async with auth_client_factory(FakeEngine()) as c:
        r = await c.post("/v1/chat/completions", json=CHAT)
        assert assert_error(r, 401)["code"] == "invalid_api_key"
        r = await c.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)
        r = await c.post("/v1/chat/completions", json=CHAT,
                         headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert (await c.get("/health")).status_code == 200


@pytest.mark.parametrize("value", ["1_000", "+5", " 5", "5 ", "0x10", "1e3", "9" * 19, "-"])
async def test_priority_header_is_a_plain_decimal_integer(client, engine, value):
    """Python's int() takes '1_000', '+5' and ' 5 '; the header takes -?digits (issue 14)."""
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Priority": value})
    assert_error(r, 400, "X-Priority")
    assert engine.requests == []


async def test_priority_header_accepts_signed_integers(client, engine):
    for value, expected in (("5", 5), ("-3", -3), ("0", 0)):
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Priority": value})
        assert r.status_code == 200, r.text
        assert engine.requests[-1].priority == expected


@pytest.mark.parametrize("value", ["x" * 65, "a b", "class\\n", "é"])
async def test_request_class_header_is_a_short_label(client, engine, value):
    """X-Request-Class is copied into logs and metrics: a 60 KB one became
    181 KB of log (issue 14); it is now 1-64 characters of [A-Za-z0-9._:-]."""
    r = await client.post("/v1/chat/completions", json=CHAT,
                          headers={"X-Request-Class": value.encode("utf-8")})
    assert_error(r, 400, "X-Request-Class")
    assert engine.requests == []
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Class": "rag-1.v2"})
    assert r.status_code == 200 and engine.requests[-1].request_class == "rag-1.v2"


@pytest.mark.parametrize("status", [429, 503, 400])
async def test_engine_refusals_echo_the_request_id(client, engine, status):
    engine.script = failing(status, "no", retry_after=1.0)
    r = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "r-42"})
    assert_error(r, status)
    assert r.headers["x-request-id"] == "r-42"


async def test_bearer_scheme_is_case_insensitive(auth_client_factory):
    """RFC 7235: the auth scheme is case-insensitive; the key is not."""
    async with auth_client_factory(FakeEngine()) as c:
        for scheme in ("bearer", "BEARER", "BeArEr"):
            r = await c.post("/v1/chat/completions", json=CHAT,
                             headers={"Authorization": f"{scheme} sekret"})
            assert r.status_code == 200, (scheme, r.text)
        for value in ("Bearer SEKRET", "Basic sekret", "Bearersekret", "sekret", "Bearer  sekret"):
            r = await c.get("/v1/models", headers={"Authorization": value})
            assert_error(r, 401)


@pytest.mark.parametrize("body, status", [
    ({"status": "ok"}, 200),
    ({"status": "degraded", "replicas_down": [1]}, 200),  # the other replicas serve
    ({"status": "unavailable", "pipeline_stages_down": [1]}, 503),  # no step can run
    ({"status": "unavailable", "replicas_down": [0, 1]}, 503),
])
async def test_health_is_503_when_the_engine_cannot_compute(client, engine, monkeypatch, body,
                                                            status):
    """Issue 47 item 8: a pipeline with a stage down (or every replica down)
    answered 200 while no request could run; a load balancer must see 503."""
    monkeypatch.setattr(engine, "health", lambda: body, raising=False)
    r = await client.get("/health")
    assert (r.status_code, r.json()) == (status, body)
