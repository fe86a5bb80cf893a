"""Every refused HTTP request leaves one ``http_refused`` line in the log
(``kvserve.api.refusal_log``): method, path, status and the error's message;
an accepted request leaves none."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from kvserve.api.refusal_log import MAX_MESSAGE_CHARS, error_message

pytestmark = pytest.mark.anyio

BODY = {"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("method, path, body, content, status, says", [
    ("POST", "/v1/chat/completions", {**BODY, "model": "gpt-4"}, None, 404, "gpt-4"),
    ("POST", "/v1/chat/completions", {**BODY, "max_tokens": -5}, None, 400, "max_tokens"),
    ("POST", "/v1/chat/completions", None, b'{"model": ', 400, "JSON"),
    ("GET", "/v1/nothing", None, None, 404, "/v1/nothing"),
])
async def test_a_refusal_is_logged_with_its_status_and_message(client, method, path, body,
                                                               content, status, says):
    with capture_logs() as logs:
        response = await client.request(method, path, json=body, content=content)
    assert response.status_code == status
    refused = [e for e in logs if e["event"] == "http_refused"]
    assert len(refused) == 1, logs
    line = refused[0]
    assert (line["method"], line["path"], line["status"]) == (method, path, status)
    assert says in line["error"] and line["error"] == response.json()["error"]["message"]


async def test_an_accepted_request_logs_no_refusal(client):
    with capture_logs() as logs:
        response = await client.post("/v1/chat/completions", json=BODY)
    assert response.status_code == 200
    assert not [e for e in logs if e["event"] == "http_refused"]


def test_error_message_reads_openai_bodies_only():
    assert error_message(b'{"error": {"message": "bad"}}') == "bad"
    assert error_message(b'{"error": {"message": "' + b"x" * 999 + b'"}}') == \
        "x" * MAX_MESSAGE_CHARS
    assert error_message(b"not json") is None
    assert error_message(b'{"detail": "x"}') is None
    assert error_message(b'["error"]') is None


async def test_unknown_request_fields_are_ignored_and_named_in_a_warning(client):
    """vLLM's behaviour: the request runs, and a warning names what it ignored."""
    with capture_logs() as logs:
        response = await client.post("/v1/chat/completions",
                                     json={**BODY, "max_token": 9, "frobnicate": 1})
    assert response.status_code == 200
    warned = [e for e in logs if e["event"] == "request_fields_ignored"]
    assert len(warned) == 1 and warned[0]["fields"] == ["frobnicate", "max_token"], logs
    with capture_logs() as logs:
        await client.post("/v1/chat/completions", json=BODY)
    assert not [e for e in logs if e["event"] == "request_fields_ignored"]


async def test_a_refused_constraint_is_not_quoted_in_the_log(client, engine):
    """Issue 47, item 6: a constraint refusal's detail quotes the user's own
    regex, grammar or schema: the client's 400 keeps it, the log line cuts
    it off (request text is logged only with --log-prompts)."""
    from fake_engine import failing

    from kvserve.core.structured_outputs import DETAIL_NOT_LOGGED

    secret = "SECRETconstraint47"
    for message, kept in (
            (f"structured_outputs: the regex constraint cannot be compiled: bad ({secret}",
             "structured_outputs: the regex constraint cannot be compiled: "),
            (f"tools[0].function.parameters: the JSON schema is invalid: Invalid type: {secret}",
             "tools[0].function.parameters: the JSON schema is invalid: ")):
        engine.script = failing(400, message, param="structured_outputs")
        with capture_logs() as logs:
            response = await client.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 400 and secret in response.json()["error"]["message"]
        [line] = [e for e in logs if e["event"] == "http_refused"]
        assert line["error"] == kept + DETAIL_NOT_LOGGED
