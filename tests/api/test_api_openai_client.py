"""The official ``openai`` client parses our responses, streams and errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine, accepted, failing, sample_outputs

from kvserve.api import build_app
from kvserve.config import ServerConfig

pytestmark = pytest.mark.anyio
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture
def make_client():
    def make(engine: FakeEngine):
        app = build_app(engine, ServerConfig(api_key="k"))
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        return openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                                  max_retries=0)
    return make


async def test_openai_chat_and_completion(make_client):
    client = make_client(FakeEngine())
    chat = await client.chat.completions.create(model="fake-model", messages=MESSAGES, n=2)
    assert [c.message.content for c in chat.choices] == ["Hello world"] * 2
    assert chat.usage.prompt_tokens_details.cached_tokens == 2
    completion = await client.completions.create(model="fake-model", prompt="x")
    assert completion.choices[0].text == "Hello world"
    models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


async def test_openai_streaming(make_client):
    client = make_client(FakeEngine())
    stream = await client.chat.completions.create(
        model="fake-model", messages=MESSAGES, stream=True,
        stream_options={"include_usage": True})
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == "Hello world" and usage.total_tokens == 5


async def test_openai_errors(make_client):
    client = make_client(FakeEngine(script=failing(429, "busy", retry_after=1)))
    with pytest.raises(openai.RateLimitError):
        await client.chat.completions.create(model="fake-model", messages=MESSAGES)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="fake-model", messages=MESSAGES,
                                             temperature=-1)
    assert info.value.param == "temperature"


# ------------------------------------------------------------------ issue 25

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "read_clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}


def call(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def answering(*pieces: str) -> FakeEngine:
    """An engine whose every answer is ``pieces`` (one token each)."""
    return FakeEngine(lambda req: [accepted(req), *sample_outputs(req, 0, list(pieces))])


async def test_openai_retrieve_model(make_client):
    client = make_client(FakeEngine())
    card = await client.models.retrieve("fake-model")
    assert card.id == "fake-model" and card.object == "model" and card.owned_by == "kvserve"
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("org/other-model")
    assert info.value.code == "model_not_found" and info.value.param == "model"
    assert "`org/other-model`" in info.value.message


async def test_openai_nulls_are_unset(make_client):
    engine = FakeEngine()
    client = make_client(engine)
    chat = await client.chat.completions.create(
        model="fake-model", messages=MESSAGES, n=None, logprobs=None, stream=None,
        temperature=None, parallel_tool_calls=None, tools=[CLOCK],
        extra_body={"min_tokens": None, "ignore_eos": None, "priority": None,
                    "skip_special_tokens": None})
    assert chat.choices[0].message.content == "Hello world"
    completion = await client.completions.create(
        model="fake-model", prompt="x", echo=None, best_of=None, n=None, logprobs=None,
        stream=True, stream_options={"include_usage": None})
    assert [c.choices[0].text async for c in completion] == ["Hello", " world"]
    assert [r.sampling_params.n for r in engine.requests] == [1, 1]


async def test_openai_best_of_is_refused(make_client):
    engine = FakeEngine()
    client = make_client(engine)
    for best_of, n in ((4, 1), (2, 3)):
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(model="fake-model", prompt="x", best_of=best_of,
                                            n=n)
        assert info.value.param == "best_of"
    assert engine.requests == []
    same = await client.completions.create(model="fake-model", prompt="x", best_of=2, n=2)
    assert len(same.choices) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_named_tool_choice_finishes_with_stop(make_client, stream):
    client = make_client(answering(call("read_clock", '{"zone": "Europe/Oslo"}')))
    kwargs = dict(model="fake-model", messages=MESSAGES, tools=[WEATHER, CLOCK],
                  tool_choice={"type": "function", "function": {"name": "read_clock"}})
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        assert choice.finish_reason == "stop"
        assert [c.function.name for c in choice.message.tool_calls] == ["read_clock"]
        return
    chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    names = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or ()]
    assert finishes == ["stop"] and names == ["read_clock"]


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_parallel_tool_calls_false_gives_one_call(make_client, stream):
    client = make_client(answering(call("get_weather", '{"city": "Quito"}'), "\n",
                                   call("read_clock", '{"zone": "UTC"}'),
                                   call("get_weather", '{"city": "Accra"}')))
    kwargs = dict(model="fake-model", messages=MESSAGES, tools=[WEATHER, CLOCK],
                  parallel_tool_calls=False)
    if not stream:
        choice = (await client.chat.completions.create(**kwargs)).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        chunks = [c async for c in await client.chat.completions.create(stream=True, **kwargs)]
        deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
        assert [t.index for t in deltas] == [0]
        calls = [(t.function.name, t.function.arguments) for t in deltas]
        choice = chunks[-1].choices[0]
    assert calls == [("get_weather", '{"city": "Quito"}')]
    assert choice.finish_reason == "tool_calls"
