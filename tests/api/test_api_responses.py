"""OpenAI's Responses API (``POST /v1/responses``, ``kvserve.api.responses``)
through the official ``openai`` client: plain, with instructions, streamed
(the client's own event accumulator checks the order), parsed into a
pydantic model (``text.format`` json_schema), a function-tool round trip
(streamed and not), ``previous_response_id`` and ``GET /v1/responses/{id}``
from the in-memory store, and the 400s of what is not supported. A scripted
engine answers (``fake_engine``)."""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest
from fake_engine import FakeEngine, accepted, sample_outputs

from kvserve.api import build_app
from kvserve.config import ServerConfig

pytestmark = pytest.mark.anyio
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}<|im_start|>assistant\n")
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def answering(engine: FakeEngine, text: str, finish: str = "stop") -> None:
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    engine.script = lambda req: [accepted(req), *sample_outputs(req, 0, pieces, finish=finish)]


@pytest.fixture
def engine() -> FakeEngine:
    engine = FakeEngine()
    engine.tokenizer.chat_template = TEMPLATE
    return engine


@pytest.fixture
def client(engine):
    app = build_app(engine, ServerConfig())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    return openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                              max_retries=0)


async def test_plain_and_with_instructions(client, engine):
    answering(engine, "Paris is the capital.")
    r = await client.responses.create(model="fake-model", input="Capital of France?",
                                      instructions="Be brief.", max_output_tokens=32,
                                      temperature=0)
    assert r.output_text == "Paris is the capital." and r.status == "completed"
    assert r.id.startswith("resp_") and r.usage.output_tokens == 5
    [request] = engine.requests
    assert request.messages == ({"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Capital of France?"})
    assert request.sampling_params.max_tokens == 32 and request.sampling_params.temperature == 0


async def test_streamed_events_in_order(client, engine):
    answering(engine, "Paris is the capital.")
    async with client.responses.stream(model="fake-model", input="Capital?") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == 5
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert final.output_text == "Paris is the capital." and final.usage.total_tokens == 8


class City(pydantic.BaseModel):
    name: str
    population: int


async def test_parse_into_a_pydantic_model(client, engine):
    answering(engine, '{"name": "Paris", "population": 2100000}')
    r = await client.responses.parse(model="fake-model", input="A city?", text_format=City)
    assert r.output_parsed == City(name="Paris", population=2100000)
    constraint = engine.requests[0].sampling_params.structured_outputs
    schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
    assert schema["required"] == ["name", "population"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_function_tool_round_trip(client, engine, stream):
    answering(engine, CALL)
    if stream:
        async with client.responses.stream(model="fake-model", input="Weather in Paris?",
                                           tools=[WEATHER]) as events:
            kinds = [event.type async for event in events]
            first = await events.get_final_response()
        assert "response.function_call_arguments.done" in kinds
    else:
        first = await client.responses.create(model="fake-model", input="Weather in Paris?",
                                              tools=[WEATHER])
    [call] = [item for item in first.output if item.type == "function_call"]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert engine.requests[0].sampling_params.structured_outputs is None  # auto: free
    answering(engine, "It is sunny in Paris.")
    second = await client.responses.create(
        model="fake-model", tools=[WEATHER],
        input=[{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": '{"sky": "sunny"}'}])
    assert second.output_text == "It is sunny in Paris."
    contents = [m["content"] for m in engine.requests[1].messages]
    assert any('"sky": "sunny"' in c for c in contents)  # the tool's result
    assert any('"city": "Paris"' in c for c in contents)  # the model's call


async def test_previous_response_id_and_the_store(client, engine):
    answering(engine, "Hello.")
    first = await client.responses.create(model="fake-model", input="Hi")
    again = await client.responses.retrieve(first.id)
    assert again.id == first.id and again.output_text == "Hello."
    answering(engine, "Fine.")
    await client.responses.create(model="fake-model", input="How are you?",
                                  previous_response_id=first.id)
    assert engine.requests[1].messages == ({"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": "Hello."},
                                           {"role": "user", "content": "How are you?"})
    unstored = await client.responses.create(model="fake-model", input="x", store=False)
    for missing in (unstored.id, "resp_nothing"):
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(missing)
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model="fake-model", input="x",
                                      previous_response_id="resp_nothing")


async def test_cut_by_max_output_tokens_is_incomplete(client, engine):
    answering(engine, "Paris is", finish="length")
    r = await client.responses.create(model="fake-model", input="Capital?", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"background": True}, "background"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": []}, "input"),
])
async def test_what_is_not_supported_is_a_400_naming_it(client, engine, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="fake-model", **{"input": "x", **fields})
    assert err.value.body["param"] == param and engine.requests == []


@pytest.mark.parametrize("fields, param, words", [
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "schema"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
])
async def test_a_400_names_the_responses_field(client, engine, fields, param, words):
    """Found by a new user: errors named the chat field a Responses field maps
    to (``max_completion_tokens``), a json_schema format without its schema
    answered ``null``, and ``conversation`` was ignored."""
    with pytest.raises(openai.BadRequestError) as err:
        await client.responses.create(model="fake-model", **{"input": "x", **fields})
    assert err.value.body["param"] == param and words in err.value.body["message"]


async def test_an_unknown_previous_response_names_its_field(client, engine):
    with pytest.raises(openai.NotFoundError) as err:
        await client.responses.create(model="fake-model", input="x",
                                      previous_response_id="resp_nothing")
    assert err.value.body["param"] == "previous_response_id"


async def test_the_message_of_an_incomplete_response_is_incomplete(client, engine):
    answering(engine, "Paris is", finish="length")
    r = await client.responses.create(model="fake-model", input="Capital?", max_output_tokens=2)
    [message] = [item for item in r.output if item.type == "message"]
    assert r.status == message.status == "incomplete"
