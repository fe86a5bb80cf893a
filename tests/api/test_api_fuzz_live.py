"""The fuzzed request bodies of ``test_api_fuzz.py``, sent to the REAL engine
(a live ``kvserve serve`` on the default model), a bounded derandomized round:
every answer is a 200 or a 4xx OpenAI error object, never a 5xx; afterwards
the engine is unharmed (the same greedy text as before the round, and no
request left running in ``/metrics``). Half of the bodies are the odd ones of
``fuzz_bodies.bodies`` (mostly refused by validation), half
``plausible_bodies`` (well-formed requests with edge values), so that many
reach the scheduler and the model."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from deadlines import HANG_DEADLINE_S, hang_message
from fuzz_bodies import bodies, plausible_bodies
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

_E2E = str(Path(__file__).resolve().parents[1] / "e2e")
if _E2E not in sys.path:
    sys.path.insert(0, _E2E)

from e2e_support import LiveServer, iter_sse_data  # noqa: E402

from kvserve.observability.metrics import parse_metrics_text  # noqa: E402

pytestmark = pytest.mark.model

MAX_EXAMPLES = 60
#: Most tokens a fuzzed request may generate per sequence (at most 16 sequences).
SMALL_MAX_TOKENS = 4
GREEDY = {"model": "SmolLM2-135M-Instruct", "temperature": 0, "max_tokens": 8,
          "messages": [{"role": "user", "content": "Name a primary colour."}]}


@pytest.fixture(scope="module")
def live(default_model_path, tmp_path_factory):
    server = LiveServer(default_model_path, tmp_path_factory.mktemp("api-fuzz-live"),
                        extra_args=["--max-model-len", "512"])
    yield server
    server.stop()


def small(body: dict) -> dict:
    """``body`` with a small generation length: a fuzzed numeric max_tokens /
    max_completion_tokens above ``SMALL_MAX_TOKENS`` (below 2**31) is lowered to
    it, and max_tokens is set when absent; odd values (negative, huge, wrong
    type) stay, so the validation of the length fields is still fuzzed."""
    body = dict(body)
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if (isinstance(value, (int, float)) and not isinstance(value, bool)
                and SMALL_MAX_TOKENS < value < 2**31):
            body[name] = SMALL_MAX_TOKENS
    body.setdefault("max_tokens", SMALL_MAX_TOKENS)
    return body


def post(client: httpx.Client, path: str, body: dict) -> tuple[int, str, object]:
    """(status, content type, parsed body: JSON, or the SSE payloads of a stream)."""
    content = json.dumps(body).encode()
    with client.stream("POST", path, content=content,
                       headers={"content-type": "application/json"}) as response:
        ctype = response.headers.get("content-type", "")
        if ctype.startswith("text/event-stream"):
            return response.status_code, ctype, list(iter_sse_data(response.iter_lines()))
        response.read()
        return response.status_code, ctype, response.json()


def greedy_text(client: httpx.Client) -> str:
    r = client.post("/v1/chat/completions", json=GREEDY)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert text
    return text


def load(client: httpx.Client) -> tuple[float, float]:
    """(``kvserve:num_requests_running``, ``kvserve:num_requests_waiting``) of ``/metrics``."""
    r = client.get("/metrics")
    assert r.status_code == 200
    samples = parse_metrics_text(r.text)
    return tuple(sum(v for _, v in samples[f"kvserve:num_requests_{name}"])
                 for name in ("running", "waiting"))


@pytest.mark.slow
def test_fuzzed_bodies_against_real_engine(live: LiveServer) -> None:
    with httpx.Client(base_url=live.base_url, timeout=httpx.Timeout(HANG_DEADLINE_S, connect=60.0)) as c:
        before = greedy_text(c)

        @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])
        @given(case=st.one_of(bodies(), plausible_bodies()))
        def fuzz_round(case) -> None:
            path, body = case
            if path.startswith("/v1"):
                body = small(body)
            status, ctype, answer = post(c, path, body)
            assert status == 200 or 400 <= status < 500, (path, body, status, answer)
            if status >= 400:
                assert ctype.startswith("application/json"), (path, body, ctype)
                assert set(answer) == {"error"}, answer
                error = answer["error"]
                assert set(error) >= {"message", "type", "param", "code"}, error
                assert isinstance(error["message"], str) and error["message"], error
                assert isinstance(error["type"], str) and error["type"], error
            elif isinstance(answer, list):  # a stream: whole, without an error event
                assert answer and answer[-1] == "[DONE]", (path, body, answer[-3:])
                chunks = [json.loads(p) for p in answer[:-1]]
                assert not [ch for ch in chunks if "error" in ch], (path, body, chunks)
            elif path.startswith("/v1"):
                assert answer["choices"], (path, body, answer)
            live.assert_alive()

        fuzz_round()

        assert greedy_text(c) == before  # the engine was not harmed
        deadline = time.monotonic() + HANG_DEADLINE_S
        while load(c) != (0, 0):
            assert time.monotonic() < deadline, hang_message(
                f"requests still running or waiting: {load(c)}", HANG_DEADLINE_S)
            time.sleep(0.1)
