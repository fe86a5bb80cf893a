"""A stop string found in the last allowed token ends the request with
``finish_reason: "stop"``, not ``"length"`` (issue 14, item 7): the stop wins
in vLLM and in the OpenAI API."""

from __future__ import annotations

import pytest
from e2e_support import post_stream

pytestmark = pytest.mark.model

#: The report's example: the fifth token is " Friday".
EXAMPLE = {"prompt": "The days of the week are Monday, Tuesday,", "max_tokens": 5,
           "temperature": 0, "stop": [" Friday"]}


def test_the_reported_example_stops(http):
    response = http.post("/v1/completions", json=EXAMPLE)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert "Friday" not in choice["text"], choice

    streamed = post_stream(http, "/v1/completions", EXAMPLE)
    reasons = [c["choices"][0]["finish_reason"] for c in streamed.choice_chunks()
               if c["choices"][0].get("finish_reason")]
    assert reasons == ["stop"], streamed.chunks


def test_the_last_tokens_own_text_as_stop_string_stops(http):
    """Another input of the kind: whatever the last of 6 greedy tokens of a
    chat reply is, a stop string equal to its text ends the request there."""
    body = {"messages": [{"role": "user", "content": "Count from one to ten."}],
            "max_tokens": 6, "temperature": 0, "logprobs": True}
    free = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert free["finish_reason"] == "length", free
    last = free["logprobs"]["content"][-1]["token"]
    text = free["message"]["content"]
    assert last.strip() and text.endswith(last) and text.find(last) == len(text) - len(last)
    stopped = http.post("/v1/chat/completions",
                        json={**body, "stop": [last]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop", stopped
    assert stopped["message"]["content"] == text[: -len(last)]
