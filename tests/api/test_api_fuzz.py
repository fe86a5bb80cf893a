"""Hypothesis fuzz of request bodies against the ASGI app (fake engine):
random JSON-ish values for the known fields, unknown fields, wrong
containers. Whatever the body, the answer is a 200 or a 4xx OpenAI error
object, never a 500."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fuzz_bodies import bodies
from hypothesis import HealthCheck, given, settings
from starlette.testclient import TestClient

from kvserve.api import build_app
from kvserve.config import ServerConfig

_client = TestClient(build_app(FakeEngine(), ServerConfig(max_request_bytes=1 << 16)),
                     raise_server_exceptions=False)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_fuzzed_bodies_never_500(case) -> None:
    path, body = case
    content = json.dumps(body).encode()
    r = _client.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (path, body, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], error
    elif path.startswith("/v1") and body.get("stream") is not True:
        assert r.json()["choices"], r.text
