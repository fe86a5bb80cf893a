"""Accepted sampling values never put a non-finite number on the wire
(issue 14, item 3): a temperature below 1e-5 is greedy, a repetition penalty
below 0.01 is a 400, and every body and event is strict JSON (no
NaN/Infinity). The -9999 floor of probability-0 logprobs is tested in
``tests/api/test_finite_logprobs.py``.

The example of the report: ``temperature`` 1e-38 with ``logprobs`` gave a
500, NaN inside streamed JSON, and garbage text instead of the greedy one.
"""

from __future__ import annotations

import json

import httpx
import pytest
from e2e_support import assert_openai_error, post_stream

pytestmark = pytest.mark.model

EXAMPLE = {"prompt": "The days of the week are", "max_tokens": 4, "logprobs": 1}


def strict_json(text: str):
    """``json.loads`` that refuses NaN, Infinity and -Infinity, as JSON does."""
    def refuse(constant: str):
        raise AssertionError(f"non-JSON number {constant} in {text[:200]!r}")

    return json.loads(text, parse_constant=refuse)


def _choice(http: httpx.Client, body: dict) -> dict:
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return strict_json(response.text)["choices"][0]


@pytest.mark.parametrize("temperature", [1e-38, 1e-320, 5e-6])
def test_a_tiny_temperature_is_greedy_with_finite_logprobs(http, temperature):
    """The same text and values as temperature 0 (this server reports raw
    logits as logprobs, ``--logprobs-mode raw_logits``)."""
    tiny = _choice(http, {**EXAMPLE, "temperature": temperature})
    greedy = _choice(http, {**EXAMPLE, "temperature": 0})
    assert tiny["text"] == greedy["text"]
    assert tiny["logprobs"]["token_logprobs"] == greedy["logprobs"]["token_logprobs"]


def test_a_tiny_temperature_streams_strict_json(http):
    result = post_stream(http, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 6,
        "temperature": 1e-38, "logprobs": True, "top_logprobs": 2})
    assert result.status == 200 and result.done
    for line in result.raw_lines:
        if line.startswith("data: {"):
            strict_json(line.removeprefix("data: "))


@pytest.mark.parametrize("penalty", [1e-320, 0.001])
def test_a_tiny_repetition_penalty_is_a_400(http, penalty):
    response = http.post("/v1/completions", json={**EXAMPLE, "repetition_penalty": penalty})
    error = assert_openai_error(response, 400)
    assert error["param"] == "repetition_penalty", error
    assert http.post("/v1/completions",
                     json={**EXAMPLE, "repetition_penalty": 0.01}).status_code == 200
