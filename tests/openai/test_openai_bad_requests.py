"""Bad requests against the live server: each gets the expected 4xx and an
OpenAI error object naming the field (``param``) and, for ranges, the limit;
a normal request succeeds after each one. Then a few random bodies (a
hypothesis fuzz; the thorough one runs against the ASGI app in
tests/api/test_api_fuzz.py) and ``--api-key``."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import API_KEY, MAX_REQUEST_BYTES, MODEL
from e2e_support import assert_openai_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.model

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMP = {"model": MODEL, "prompt": "Hello", "max_tokens": 1}
C, P = "/v1/chat/completions", "/v1/completions"
INVALID = "invalid_request_error"

# (id, path, body (dict, or raw bytes), headers, status, param, text the message must hold)
BAD = [
    ("bad-json", C, b'{"messages": [', {}, 400, None, "JSON"),
    ("nan-is-not-json", C, b'{"messages": [], "temperature": NaN}', {}, 400, None, "NaN"),
    ("body-not-object", C, b"[1, 2]", {}, 400, None, "object"),
    ("wrong-content-type", C, b"a=b", {"content-type": "application/x-www-form-urlencoded"},
     415, None, "application/json"),
    ("messages-missing", C, {"model": MODEL}, {}, 400, "messages", "messages"),
    ("messages-empty", C, {**CHAT, "messages": []}, {}, 400, "messages", "1"),
    ("messages-not-list", C, {**CHAT, "messages": "hi"}, {}, 400, "messages", ""),
    ("bad-role", C, {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, {}, 400,
     "messages.0.role", ""),
    ("content-int", C, {**CHAT, "messages": [{"role": "user", "content": 5}]}, {}, 400,
     "messages.0.content", ""),
    ("max-tokens-string", C, {**CHAT, "max_tokens": "10"}, {}, 400, "max_tokens", ""),
    ("max-tokens-zero", C, {**CHAT, "max_tokens": 0}, {}, 400, "max_tokens", ">= 1"),
    ("max-tokens-negative", P, {**COMP, "max_tokens": -5}, {}, 400, "max_tokens", ">= 1"),
    ("max-tokens-huge", P, {**COMP, "max_tokens": 10**12}, {}, 400, "max_tokens", "512"),
    ("max-completion-tokens-zero", C, {**CHAT, "max_completion_tokens": 0}, {}, 400,
     "max_completion_tokens", ">= 1"),
    ("temperature-negative", C, {**CHAT, "temperature": -0.5}, {}, 400, "temperature", ">= 0"),
    ("temperature-string", C, {**CHAT, "temperature": "hot"}, {}, 400, "temperature", ""),
    ("top-p-above-1", C, {**CHAT, "top_p": 1.5}, {}, 400, "top_p", "1"),
    ("top-p-negative", P, {**COMP, "top_p": -0.1}, {}, 400, "top_p", "1"),
    ("n-zero", C, {**CHAT, "n": 0}, {}, 400, "n", "[1, 16]"),
    ("n-over-limit", P, {**COMP, "n": 17}, {}, 400, "n", "16"),
    ("n-float", C, {**CHAT, "n": 1.5}, {}, 400, "n", ""),
    ("completion-logprobs-too-large", P, {**COMP, "logprobs": 21}, {}, 400, "logprobs", "20"),
    ("completion-logprobs-bool", P, {**COMP, "logprobs": True}, {}, 400, "logprobs", ""),
    ("top-logprobs-too-large", C, {**CHAT, "logprobs": True, "top_logprobs": 21}, {}, 400,
     "top_logprobs", "20"),
    ("top-logprobs-without-logprobs", C, {**CHAT, "top_logprobs": 2}, {}, 400,
     "top_logprobs", "logprobs"),
    ("presence-penalty", C, {**CHAT, "presence_penalty": 5}, {}, 400, "presence_penalty", "2"),
    ("frequency-penalty", P, {**COMP, "frequency_penalty": -3}, {}, 400,
     "frequency_penalty", "2"),
    ("repetition-penalty-zero", P, {**COMP, "repetition_penalty": 0}, {}, 400,
     "repetition_penalty", ">= 0.01"),
    ("min-p", P, {**COMP, "min_p": 2}, {}, 400, "min_p", "1"),
    ("top-k", P, {**COMP, "top_k": -2}, {}, 400, "top_k", "-1"),
    ("seed-huge", P, {**COMP, "seed": 2**70}, {}, 400, "seed", "9223372036854775807"),
    ("seed-string", P, {**COMP, "seed": "x"}, {}, 400, "seed", ""),
    ("stop-not-strings", C, {**CHAT, "stop": [1]}, {}, 400, "stop.0", ""),
    ("stream-not-bool", C, {**CHAT, "stream": "yes"}, {}, 400, "stream", ""),
    ("stream-options", C, {**CHAT, "stream_options": {"include_usage": 1}}, {}, 400,
     "stream_options.include_usage", ""),
    ("min-tokens-over-max", P, {**COMP, "min_tokens": 5}, {}, 400, "min_tokens", "max_tokens"),
    ("logit-bias-key", P, {**COMP, "logit_bias": {"abc": 1}}, {}, 400, "logit_bias", ""),
    ("logit-bias-value", P, {**COMP, "logit_bias": {"1": 500}}, {}, 400, "logit_bias", "100"),
    ("logit-bias-vocab", P, {**COMP, "logit_bias": {"999999": 1}}, {}, 400, "logit_bias",
     "49152"),
    ("stop-token-ids-negative", P, {**COMP, "stop_token_ids": [-1]}, {}, 400,
     "stop_token_ids", "vocabulary"),
    ("unknown-model", C, {**CHAT, "model": "gpt-9"}, {}, 404, "model", "gpt-9"),
    ("prompt-missing", P, {"model": MODEL}, {}, 400, "prompt", ""),
    ("prompt-empty-string", P, {**COMP, "prompt": ""}, {}, 400, "prompt", "empty"),
    ("prompt-empty-list", P, {**COMP, "prompt": []}, {}, 400, "prompt", "empty"),
    ("prompt-empty-token-list", P, {**COMP, "prompt": [[]]}, {}, 400, "prompt", "empty"),
    ("prompt-batch", P, {**COMP, "prompt": ["a", "b"]}, {}, 400, "prompt", "one prompt"),
    ("prompt-token-out-of-vocab", P, {**COMP, "prompt": [10**9]}, {}, 400, "prompt",
     "vocabulary"),
    ("prompt-token-negative", P, {**COMP, "prompt": [-1]}, {}, 400, "prompt", "vocabulary"),
    ("prompt-too-long", P, {**COMP, "prompt": "hello " * 600}, {}, 400, "prompt", "512"),
    ("prompt-plus-max-tokens", P, {**COMP, "max_tokens": 512}, {}, 400, "max_tokens", "512"),
    ("oversized-body", P, {**COMP, "prompt": "x" * (MAX_REQUEST_BYTES + 10)}, {}, 413, None,
     str(MAX_REQUEST_BYTES)),
    ("bad-priority-header", P, COMP, {"X-Priority": "high"}, 400, "X-Priority", "integer"),
    ("tokenize-nothing", "/tokenize", {"model": MODEL}, {}, 400, "prompt", "prompt"),
    ("detokenize-bad-id", "/detokenize", {"tokens": [-3]}, {}, 400, "tokens", "vocabulary"),
]


def _post(http: httpx.Client, path: str, body, headers: dict) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body,
                         headers={"content-type": "application/json", **headers})
    return http.post(path, json=body, headers=headers)


def _assert_normal_request_works(http: httpx.Client) -> None:
    r = http.post(P, json=COMP)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_table_has_at_least_30_cases() -> None:
    assert len(BAD) >= 30


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request(http, case) -> None:
    _, path, body, headers, status, param, needle = case
    error = assert_openai_error(_post(http, path, body, headers), status)
    assert error["type"] == INVALID
    assert error["param"] == param, error
    assert needle in error["message"], error
    _assert_normal_request_works(http)


_ODD = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
                 st.lists(st.integers(min_value=-5, max_value=60000), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
_FIELDS = ["temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
           "logprobs", "echo", "stream", "stream_options", "user", "priority",
           "skip_special_tokens", "include_stop_str_in_output", "prompt", "model"]


@st.composite
def _live_bodies(draw) -> dict:
    """Completions bodies with odd values, kept cheap: at most 2 tokens, n <= 2."""
    body = {"prompt": "Hi", "max_tokens": draw(st.sampled_from([1, 2, 0, -1, "1", 10**9]))}
    body["n"] = draw(st.sampled_from([1, 2, 0, 17, "2"]))
    for name in draw(st.lists(st.sampled_from(_FIELDS), max_size=4, unique=True)):
        body[name] = draw(_ODD)
    return body


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=_live_bodies())
def test_live_fuzz_no_500(http, body) -> None:
    content = json.dumps(body).encode()  # NaN/Infinity as Python writes them: a 400
    r = http.post(P, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
    if isinstance(body.get("stream"), bool) and body["stream"]:
        return
    _assert_normal_request_works(http)


def test_api_key(server) -> None:
    with httpx.Client(base_url=server.base_url, timeout=120.0) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            r = anon.post(P, json=COMP, headers=headers)
            error = assert_openai_error(r, 401)
            assert error["code"] == "invalid_api_key"
            assert assert_openai_error(anon.get("/v1/models", headers=headers), 401)
        assert anon.get("/health").status_code == 200
        ok = anon.post(P, json=COMP, headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        for path in ("/v1/models", "/version"):
            assert anon.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code \
                == 200
