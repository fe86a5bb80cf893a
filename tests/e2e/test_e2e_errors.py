"""Acceptance: bad requests get a 4xx OpenAI error object (never a 500, never
a hang), and the live server serves a normal request right after each.

The server runs with ``--max-model-len 512`` (see conftest), so a prompt of a
few hundred words is already too long.
"""

from __future__ import annotations

import httpx
import pytest
from e2e_support import SERVER_MAX_MODEL_LEN, assert_openai_error, post_stream

pytestmark = pytest.mark.model

LONG_TEXT = "hello " * (SERVER_MAX_MODEL_LEN + 100)
CHAT = [{"role": "user", "content": "Hi"}]


def _normal_request_succeeds(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": "The quick brown fox",
                                                  "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] == "length"


def _post_raw(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


# name -> (send(http) -> response, expected status, expected param or ...: not checked)
BAD_REQUESTS = {
    "malformed_json": (lambda h: _post_raw(h, "/v1/chat/completions",
                                           b'{"messages": [{"role": "user", '), 400, ...),
    "malformed_json_completions": (lambda h: _post_raw(h, "/v1/completions", b"{prompt: hi}"),
                                   400, ...),
    "body_not_an_object": (lambda h: _post_raw(h, "/v1/completions", b'["hi"]'), 400, ...),
    "wrong_field_type": (lambda h: h.post("/v1/chat/completions",
                                          json={"messages": CHAT, "max_tokens": "7"}),
                         400, "max_tokens"),
    "missing_messages": (lambda h: h.post("/v1/chat/completions", json={"max_tokens": 3}),
                         400, "messages"),
    "unknown_route": (lambda h: h.post("/v1/nope", json={"prompt": "hi"}), 404, ...),
    "unknown_route_get": (lambda h: h.get("/v2/models"), 404, ...),
    "wrong_method": (lambda h: h.get("/v1/chat/completions"), 405, ...),
    "unknown_model": (lambda h: h.post("/v1/completions",
                                       json={"model": "gpt-17", "prompt": "hi"}), 404, "model"),
    "prompt_too_long_completions": (lambda h: h.post("/v1/completions",
                                                     json={"prompt": LONG_TEXT, "max_tokens": 4}),
                                    400, ...),
    "prompt_too_long_chat": (lambda h: h.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 4}), 400, ...),
    "prompt_plus_max_tokens_too_long": (lambda h: h.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": SERVER_MAX_MODEL_LEN}), 400, "max_tokens"),
    "prompt_token_id_out_of_vocab": (lambda h: h.post("/v1/completions", json={
        "prompt": [1, 2, 10**9], "max_tokens": 2}), 400, "prompt"),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_then_server_still_serves(http, name: str) -> None:
    send, status, param = BAD_REQUESTS[name]
    error = assert_openai_error(send(http), status)
    if param is not ...:
        assert error["param"] == param, error
    _normal_request_succeeds(http)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": LONG_TEXT, "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}],
                              "max_tokens": 4}),
], ids=["completions", "chat"])
def test_too_long_prompt_streaming_gets_json_400(http, path: str, body: dict) -> None:
    """With ``stream: true`` the refusal is still a plain JSON 400, not an SSE stream."""
    result = post_stream(http, path, body)
    assert result.status == 400, (result.status, result.chunks, result.body)
    assert result.body is not None, "expected a JSON error body, got an event stream"
    assert set(result.body) == {"error"} and result.body["error"]["message"]
    _normal_request_succeeds(http)


def test_too_long_completions_prompt_error_names_prompt(http) -> None:
    response = http.post("/v1/completions", json={"prompt": LONG_TEXT, "max_tokens": 4})
    error = assert_openai_error(response, 400)
    assert error["param"] == "prompt", error


def test_client_disconnect_mid_stream_then_server_still_serves(http) -> None:
    """A client that leaves mid-stream does not disturb the next request."""
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    _normal_request_succeeds(http)


def test_a_prompt_longer_than_any_context_is_refused_before_tokenizing(http) -> None:
    """Issue 14, item 2: the 400 comes from the character bound (max_model_len
    x the longest token's bytes), not from tokenizing 100,000 characters."""
    for body, path in (({"prompt": "x" * 100_000, "max_tokens": 1}, "/v1/completions"),
                       ({"messages": [{"role": "user", "content": "x" * 100_000}]},
                        "/v1/chat/completions")):
        error = assert_openai_error(http.post(path, json=body), 400)
        assert "can hold" in error["message"], error
    _normal_request_succeeds(http)
