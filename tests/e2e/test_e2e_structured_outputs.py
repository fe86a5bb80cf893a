"""Acceptance (issue 15, structured outputs), through the official ``openai``
client against the live server:

- ``json_schema`` outputs validate (``jsonschema``, the reference validator)
  against each of 20 schemas, greedy and sampled, streamed and not;
- ``json_object`` output parses as a JSON object;
- vLLM's ``guided_choice`` / ``guided_regex`` / ``guided_grammar`` hold;
- a constrained and an unconstrained request in one batch each get the
  right output (the unconstrained one equals its answer alone);
- a schema the engine cannot compile is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import openai
import pytest
from structured_schemas import SCHEMAS, prompt_for

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 160


def response_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                    "strict": True}}


async def ask(client: openai.AsyncOpenAI, name: str, schema: dict, *, stream: bool,
              sampled: bool) -> tuple[str, str]:
    """The content and finish reason of one constrained chat completion."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt_for(name)}],
                  max_tokens=MAX_TOKENS, response_format=response_format(name, schema),
                  temperature=0.9 if sampled else 0.0, seed=7 if sampled else None)
    if not stream:
        response = await client.chat.completions.create(**kwargs)
        return response.choices[0].message.content, response.choices[0].finish_reason
    text, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.fixture
def aclient(live_server):
    return openai.AsyncOpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused",
                              timeout=300, max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.slow
def test_json_schema_outputs_validate_on_20_schemas(aclient, stream: bool) -> None:
    async def all_schemas():
        jobs = [ask(aclient, name, schema, stream=stream, sampled=sampled)
                for name, schema in SCHEMAS for sampled in (False, True)]
        return await asyncio.gather(*jobs)

    results = asyncio.run(all_schemas())
    cases = [(name, schema, sampled) for name, schema in SCHEMAS for sampled in (False, True)]
    for (name, schema, sampled), (text, finish) in zip(cases, results, strict=True):
        assert finish == "stop", f"{name} (sampled={sampled}) did not finish: {text!r}"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_json_object_output_parses(http) -> None:
    for temperature in (0.0, 0.8):
        response = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Give me a JSON object about a cat."}],
            "max_tokens": 100, "temperature": temperature, "seed": 1,
            "response_format": {"type": "json_object"}})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:  # cut by max_tokens: still the start of an object
            assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no",
                                                                          "maybe")),
    ({"structured_outputs": {"regex": "(cat|dog)s?"}}, lambda t: re.fullmatch("(cat|dog)s?", t)),
])
def test_vllm_guided_fields(http, extra: dict, check) -> None:
    for path, body in (("/v1/chat/completions", {"messages": [
            {"role": "user", "content": "Is this review good? 'Loved it.'"}]}),
            ("/v1/completions", {"prompt": "Answer:"})):
        response = http.post(path, json={**body, "max_tokens": 20, "temperature": 0, **extra})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert check(text), text
        assert choice["finish_reason"] == "stop"


def test_constrained_and_unconstrained_in_one_batch(aclient) -> None:
    name, schema = SCHEMAS[0]
    plain = {"model": MODEL, "messages": [{"role": "user", "content": prompt_for(name)}],
             "max_tokens": 24, "temperature": 0.0}

    async def alone_then_together():
        alone = await aclient.chat.completions.create(**plain)
        return alone.choices[0].message.content, await asyncio.gather(
            aclient.chat.completions.create(**plain),
            ask(aclient, name, schema, stream=False, sampled=False),
            aclient.chat.completions.create(**plain),
            ask(aclient, name, schema, stream=True, sampled=True))

    reference, (first, constrained, second, sampled) = asyncio.run(alone_then_together())
    for response in (first, second):
        assert response.choices[0].message.content == reference
    for text, finish in (constrained, sampled):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "frobnicate"}}}}}),
    ("guided_json", {"type": "nonsense"}),
    ("guided_regex", "[0-9"),
    ("guided_grammar", "root ::= ("),
])
def test_a_constraint_that_does_not_compile_is_a_400_naming_it(http, field, value) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "cannot be compiled" in error["message"], error


def test_two_constraints_are_a_400(http) -> None:
    response = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "guided_regex": "a+", "response_format": {"type": "json_object"}})
    assert response.status_code == 400
    assert "only one structured-output constraint" in response.json()["error"]["message"]
