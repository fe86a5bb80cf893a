"""Response and stream shapes of /v1/chat/completions and /v1/completions."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine, accepted, sample_outputs

from kvserve.actors.messages import RequestFailed

pytestmark = pytest.mark.anyio

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "fake-model", "prompt": "Once upon"}


def parse_sse(text: str) -> list:
    """Split an SSE body into decoded ``data:`` payloads (``"[DONE]"`` kept as str)."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_chat_non_streaming_shape(client, engine):
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-") and r.headers["x-request-id"] == body["id"]
    assert body["model"] == "fake-model"
    [choice] = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["content"] == "Hello world"
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"] is None
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    sent = engine.requests[0]
    assert sent.messages == ({"role": "user", "content": "Hi"},)
    assert sent.sampling_params.max_tokens is None


async def test_completion_non_streaming_shape(client, engine):
    r = await client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == "Hello world" and choice["finish_reason"] == "stop"
    assert body["usage"]["total_tokens"] == 5
    assert engine.requests[0].prompt == "Once upon"
    assert engine.requests[0].sampling_params.max_tokens == 16


async def test_n2_non_streaming(client, engine):
    r = await client.post("/v1/chat/completions", json={**CHAT, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["message"]["content"] == "Hello world" for c in body["choices"])
    assert body["usage"]["completion_tokens"] == 4
    assert body["usage"]["prompt_tokens"] == 3


async def test_chat_streaming(client):
    r = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    assert all(d.get("content") for d in deltas)  # no empty-content chunks
    assert "".join(d["content"] for d in deltas) == "Hello world"
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, "stop"]
    assert all("usage" not in c for c in chunks)


async def test_chat_streaming_include_usage(client):
    payload = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    events = parse_sse((await client.post("/v1/chat/completions", json=payload)).text)
    assert events[-1] == "[DONE]"
    usage_chunks = [e for e in events[:-1] if e.get("usage")]
    assert len(usage_chunks) == 1 and usage_chunks[0] is events[-2]
    assert usage_chunks[0]["choices"] == []
    assert usage_chunks[0]["usage"]["total_tokens"] == 5
    assert all(e["usage"] is None for e in events[:-2])


async def test_chat_streaming_n2(client):
    payload = {**CHAT, "stream": True, "n": 2}
    events = parse_sse((await client.post("/v1/chat/completions", json=payload)).text)
    texts = {0: "", 1: ""}
    roles = set()
    finishes = {}
    for chunk in events[:-1]:
        [choice] = chunk["choices"]
        delta = choice["delta"]
        if "role" in delta:
            roles.add(choice["index"])
        texts[choice["index"]] += delta.get("content", "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert roles == {0, 1} and texts == {0: "Hello world", 1: "Hello world"}
    assert finishes == {0: "stop", 1: "stop"}


async def test_completion_streaming(client):
    payload = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    r = await client.post("/v1/completions", json=payload)
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == "Hello world"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 2


async def test_streaming_empty_final_output_gets_finish_chunk(engine, client):
    def script(req):
        outs = sample_outputs(req, 0, ["Hi", ""], finish="length")
        return [accepted(req), *outs]
    engine.script = script
    events = parse_sse((await client.post("/v1/chat/completions",
                                          json={**CHAT, "stream": True})).text)
    last = events[-2]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"


async def test_streaming_failure_mid_way(engine, client):
    def script(req):
        return [accepted(req), *sample_outputs(req, 0, ["Hi", "x"])[:1],
                RequestFailed(req.request_id, 500, "step failed", type="server_error")]
    engine.script = script
    events = parse_sse((await client.post("/v1/chat/completions",
                                          json={**CHAT, "stream": True})).text)
    assert events[-1] == "[DONE]"
    assert events[-2] == {"error": {"message": "step failed", "type": "server_error",
                                    "param": None, "code": None}}
    assert engine.aborted == []


async def test_non_streaming_failure_mid_way_is_500(engine, client):
    def script(req):
        return [accepted(req), RequestFailed(req.request_id, 500, "boom", type="server_error")]
    engine.script = script
    r = await client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "boom"


async def test_chat_logprobs(client, engine):
    r = await client.post("/v1/chat/completions",
                          json={**CHAT, "logprobs": True, "top_logprobs": 2})
    assert engine.requests[0].sampling_params.logprobs == 2
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert content[0] == {"token": "t0", "logprob": -0.5, "bytes": [116, 48],
                          "top_logprobs": [{"token": "t0", "logprob": -0.5, "bytes": [116, 48]},
                                           {"token": "t1", "logprob": -1.5,
                                            "bytes": [116, 49]}]}


async def test_completion_logprobs_streaming_and_not(client):
    r = await client.post("/v1/completions", json={**COMPLETION, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["t0", "t1"]
    assert lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"][0] == {"t0": -0.5, "t1": -1.5}
    assert lp["text_offset"] == [0, 5]  # offsets in the text ("Hello" + " world")
    events = parse_sse((await client.post(
        "/v1/completions", json={**COMPLETION, "logprobs": 2, "stream": True})).text)
    offsets = [e["choices"][0]["logprobs"]["text_offset"] for e in events[:-1]]
    assert offsets == [[0], [5]]


async def test_token_prompt_and_headers(client, engine):
    r = await client.post("/v1/completions", json={"prompt": [1, 2, 3], "priority": 5},
                          headers={"X-Request-Id": "my-req-1", "X-Request-Class": "batch"})
    assert r.status_code == 200 and r.json()["id"] == "my-req-1"
    sent = engine.requests[0]
    assert sent.prompt_token_ids == (1, 2, 3) and sent.prompt is None
    assert sent.priority == 5 and sent.request_class == "batch"


async def test_priority_header_wins(client, engine):
    await client.post("/v1/completions", json={**COMPLETION, "priority": 5},
                      headers={"X-Priority": "-2"})
    assert engine.requests[0].priority == -2


async def test_sampling_fields_are_passed(client, engine):
    payload = {**CHAT, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.9,
               "top_k": 40, "min_p": 0.1, "seed": 3, "stop": "END",
               "stop_token_ids": [5], "ignore_eos": True, "min_tokens": 1,
               "presence_penalty": 0.5, "frequency_penalty": 0.25,
               "repetition_penalty": 1.1, "user": "bob",
               "messages": [{"role": "system", "content": "Be brief"},
                            {"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}]}
    r = await client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 200, r.text
    sp = engine.requests[0].sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.seed) == \
        (7, 0, 0.9, 40, 0.1, 3)
    assert sp.stop == ("END",) and sp.stop_token_ids == (5,) and sp.ignore_eos
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, 0.25, 1.1)
    assert engine.requests[0].messages[1] == {"role": "user", "content": "a\nb"}


async def test_models_and_health(client, engine):
    r = await client.get("/v1/models")
    assert r.json()["object"] == "list"
    [card] = r.json()["data"]
    assert card["id"] == "fake-model" and card["object"] == "model"
    assert card["owned_by"] == "kvserve" and card["max_model_len"] == 4096
    assert (await client.get("/health")).status_code == 200
    engine.ready = False
    r = await client.get("/health")
    assert r.status_code == 503 and "error" in r.json()


def test_fake_engine_default_usable_without_client():
    assert FakeEngine().is_ready()
