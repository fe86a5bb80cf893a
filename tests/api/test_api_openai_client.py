"""The official ``openai`` client parses our responses, streams and errors."""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine, failing

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
