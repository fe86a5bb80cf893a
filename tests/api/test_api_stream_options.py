"""``stream_options`` rules (issue 15, item 6): refused without ``stream``
(as OpenAI and vLLM do), and vLLM's ``continuous_usage_stats`` puts the usage
so far in every chunk; ``/detokenize`` keeps special tokens."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT),
                                        ("/v1/completions", {"prompt": "hi"})])
async def test_stream_options_without_stream_is_a_400(client, path, body):
    r = await client.post(path, json={**body, "stream_options": {"include_usage": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options"


async def test_continuous_usage_stats_in_every_chunk(client):
    r = await client.post("/v1/chat/completions", json={
        **CHAT, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages), usages
    completion = [u["completion_tokens"] for u in usages]
    assert completion == sorted(completion) and completion[-1] == 2  # "Hello", " world"
    assert {u["prompt_tokens"] for u in usages} == {3}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)


async def test_plain_include_usage_keeps_null_usage_until_the_end(client):
    r = await client.post("/v1/chat/completions", json={
        **CHAT, "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
