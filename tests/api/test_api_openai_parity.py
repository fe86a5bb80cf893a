"""Answers as OpenAI's API and vLLM give them (issue 25): a JSON ``null``
for an optional field means "unset" (the default), in nested objects too;
``best_of`` other than ``n`` is refused, never ignored; ``GET
/v1/models/{model}`` retrieves the model card."""

from __future__ import annotations

import json

import httpx
import pytest
from fake_engine import FakeEngine
from pydantic import TypeAdapter, ValidationError

from kvserve.api import build_app
from kvserve.api.protocol import _request_models
from kvserve.config import ServerConfig

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Name a prime.", "name": None}]
CLOCK = {"type": "function", "function": {"name": "read_clock", "description": None,
                                          "parameters": None, "strict": None}}


def refusal(r: httpx.Response, param: str) -> str:
    """The message of a 400 naming ``param``, in OpenAI's error shape."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    return error["message"]


# --------------------------------------------------------------------------- null


async def test_chat_nulls_mean_the_defaults(client, engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": ASK, "n": None, "logprobs": None, "stream": None, "echo": None,
        "ignore_eos": None, "min_tokens": None, "skip_special_tokens": None,
        "include_stop_str_in_output": None, "priority": None, "parallel_tool_calls": None,
        "tools": [CLOCK], "tool_choice": None, "top_logprobs": None, "seed": None,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": None, "schema": {"type": "integer"}, "strict": None}}})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")  # stream: null is false
    [choice] = r.json()["choices"]
    assert choice["logprobs"] is None
    request = engine.requests[0]
    params = request.sampling_params
    assert (params.n, params.min_tokens, params.ignore_eos, params.skip_special_tokens,
            params.include_stop_str_in_output, params.logprobs) == (1, 0, False, True, False, None)
    assert request.priority == 0 and params.structured_outputs is not None


async def test_completion_nulls_mean_the_defaults_and_nullable_fields_keep_null(client, engine):
    r = await client.post("/v1/completions", json={
        "prompt": "Seven is", "echo": None, "parse_special": None, "best_of": None, "n": None,
        "logprobs": None, "max_tokens": None, "stream": True,
        "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"  # no echo
    assert all(c["choices"] for c in chunks), "include_usage: null adds no usage chunk"
    params = engine.requests[0].sampling_params
    assert params.n == 1 and params.logprobs is None
    assert params.max_tokens is None  # null is "no limit" here, not the default 16


#: The smallest valid body of each request object (a new one must be added).
MINIMAL = {
    "TextPart": {"type": "text", "text": "t"}, "FunctionCall": {"name": "f", "arguments": "{}"},
    "ToolCall": {"function": {"name": "f", "arguments": "{}"}}, "ChatMessage": {"role": "tool"},
    "FunctionDefinition": {"name": "f"}, "ToolDefinition": CLOCK, "NamedFunction": {"name": "f"},
    "NamedToolChoice": {"type": "function", "function": {"name": "f"}}, "StreamOptions": {},
    "JsonSchemaFormat": {}, "ResponseFormat": {"type": "json_object"},
    "StructuredOutputsField": {}, "_CommonRequest": {}, "ChatCompletionRequest": {"messages": ASK},
    "CompletionRequest": {"prompt": [7]}, "TokenizeRequest": {},
    "DetokenizeRequest": {"tokens": []},
}


@pytest.mark.parametrize("model", _request_models(), ids=lambda m: m.__name__)
def test_null_for_every_optional_field_of_every_request_object(model):
    """Every optional field at once null: the defaults, except that a field
    typed ``X | None`` holds None (``CompletionRequest.max_tokens``: 16 -> None)."""
    minimal = MINIMAL[model.__name__]
    optional = {name: info for name, info in model.model_fields.items()
                if not info.is_required()}
    nulls = {info.alias or name: None for name, info in optional.items()}
    got = model.model_validate({**minimal, **nulls}).model_dump()
    expected = model.model_validate(minimal).model_dump()
    for name, info in optional.items():
        try:
            TypeAdapter(info.annotation).validate_python(None)
        except ValidationError:
            continue  # no None in its type: keeps the default
        expected[name] = None
    assert got == expected


async def test_tokenize_nulls_mean_the_defaults(client):
    r = await client.post("/tokenize", json={"prompt": "ab", "add_special_tokens": None,
                                             "return_token_strs": None})
    assert r.status_code == 200, r.text
    assert r.json()["count"] == 2 and r.json()["token_strs"] is None


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": None}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": None, "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": None}]}]}, "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function",
                                                         "function": None}]},
     "tools.0.function"),
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/detokenize", {"tokens": None}, "tokens"),
])
async def test_null_for_a_required_field_stays_an_error(client, engine, path, body, param):
    refusal(await client.post(path, json=body), param)
    assert engine.requests == []


# --------------------------------------------------------------------------- best_of


@pytest.mark.parametrize("stream", [False, True])
async def test_best_of_above_n_is_refused_not_ignored(client, engine, stream):
    r = await client.post("/v1/completions", json={"prompt": "x", "best_of": 5, "n": 2,
                                                   "stream": stream})
    message = refusal(r, "best_of")
    assert "not" in message and "vLLM" in message
    assert "`n`" in message and "logprobs" in message  # what to use instead
    assert engine.requests == []


async def test_best_of_below_n_is_refused(client, engine):
    message = refusal(await client.post("/v1/completions", json={
        "prompt": "x", "best_of": 1, "n": 3}), "best_of")
    assert "greater than or equal to n" in message


async def test_best_of_equal_to_n_returns_all_samples(client, engine):
    r = await client.post("/v1/completions", json={"prompt": "x", "best_of": 3, "n": 3})
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["Hello world"] * 3
    r = await client.post("/v1/completions", json={"prompt": "x", "best_of": 1})
    assert r.status_code == 200, r.text


async def test_best_of_in_a_chat_body_is_an_unknown_field(client):
    r = await client.post("/v1/chat/completions", json={"messages": ASK, "best_of": 4})
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- models


async def test_retrieve_the_model_card(client):
    listed = (await client.get("/v1/models")).json()["data"]
    r = await client.get("/v1/models/fake-model")
    assert r.status_code == 200, r.text
    assert [r.json()] == listed


async def test_a_model_that_is_not_served_is_a_404(client):
    """OpenAI's words, then the model this server serves (issue 48, item 5:
    a user whose request names another model learns which one to name)."""
    r = await client.get("/v1/models/fake-model-2")
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "The model `fake-model-2` does not exist; this "
                                             "server serves `fake-model`.",
                                  "type": "invalid_request_error", "param": "model",
                                  "code": "model_not_found"}}


async def test_a_served_name_with_slashes_and_the_key():
    config = ServerConfig(served_model_name="acme/tiny-chat", api_key="sesame")
    app = build_app(FakeEngine(), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as http:
        assert (await http.get("/v1/models/acme/tiny-chat")).status_code == 401
        headers = {"Authorization": "Bearer sesame"}
        for name in ("acme/tiny-chat", "acme%2Ftiny-chat", "fake-model"):  # served, engine's
            r = await http.get(f"/v1/models/{name}", headers=headers)
            assert r.status_code == 200, (name, r.text)
            assert r.json()["id"] == "acme/tiny-chat" and r.json()["root"] == "fake-model"
        r = await http.get("/v1/models/acme/other", headers=headers)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
