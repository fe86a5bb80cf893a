"""Hypothesis fuzz of request bodies against the ASGI app (fake engine):
random JSON-ish values for the known fields, unknown fields, wrong
containers. Whatever the body, the answer is a 200 or a 4xx OpenAI error
object, never a 500."""

from __future__ import annotations

import json

from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from kvserve.api import build_app
from kvserve.config import ServerConfig

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**80, max_value=2**80),
    st.sampled_from([0, 1, -1, 16, 17, 20, 21, 2**63, -2**63 - 1, 4096, 10**9]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -0.0, 1e-300, 1e308]),
    st.text(max_size=12), st.sampled_from(["", "1", "abc", "\x00", "🎉"]))
JSONISH = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
MESSAGE = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
    ["user", "system", "assistant", "tool", "developer"]), JSONISH)},
    optional={"content": st.one_of(st.text(max_size=20), JSONISH,
                                   st.lists(st.fixed_dictionaries(
                                       {"type": st.just("text"), "text": JSONISH})))})
COMMON = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop",
          "stop_token_ids", "ignore_eos", "min_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "skip_special_tokens",
          "include_stop_str_in_output", "stream", "stream_options", "priority", "user",
          "logprobs", "echo", "top_logprobs", "max_completion_tokens", "unknown_field"]
ODD_FIELD = {
    "logit_bias": st.dictionaries(st.one_of(st.text(max_size=6),
                                            st.integers(-5, 10**7).map(str)), JSONISH,
                                  max_size=3),
    "stream_options": st.one_of(JSONISH, st.fixed_dictionaries({"include_usage": JSONISH})),
    "stop": st.one_of(JSONISH, st.lists(st.text(max_size=5), max_size=3)),
    "prompt": st.one_of(st.text(max_size=20), JSONISH,
                        st.lists(st.integers(-10, 10**7), max_size=4),
                        st.lists(st.lists(st.integers(-10, 10**7), max_size=3), max_size=3)),
    "messages": st.one_of(JSONISH, st.lists(MESSAGE, max_size=3)),
    "tokens": st.one_of(JSONISH, st.lists(st.integers(-10, 2**70), max_size=4)),
}


@st.composite
def bodies(draw):
    """(path, body): a route and a dict over its fields with odd values."""
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize",
                                 "/detokenize"]))
    own = {"/v1/chat/completions": ["messages"], "/v1/completions": ["prompt"],
           "/tokenize": ["prompt", "messages", "add_special_tokens"],
           "/detokenize": ["tokens"]}[path]
    body = {}
    for name in own:
        if draw(st.integers(0, 9)) > 0:
            body[name] = draw(ODD_FIELD.get(name, JSONISH))
    for name in draw(st.lists(st.sampled_from(COMMON), max_size=6, unique=True)):
        body[name] = draw(ODD_FIELD.get(name, JSONISH))
    return path, body


_client = TestClient(build_app(FakeEngine(), ServerConfig(max_request_bytes=1 << 16)),
                     raise_server_exceptions=False)


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
