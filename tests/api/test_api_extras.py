"""``/tokenize``, ``/detokenize``, ``/version``, completions ``echo``,
``--log-prompts`` and non-JSON numbers, against the fake engine."""

from __future__ import annotations

import json

import pytest
import structlog
from fake_engine import sample_outputs, accepted

pytestmark = pytest.mark.anyio


async def test_tokenize_prompt_and_messages(client):
    r = await client.post("/tokenize", json={"prompt": "abc"})
    assert r.json() == {"count": 3, "max_model_len": 4096, "tokens": [97, 98, 99],
                        "token_strs": None}
    r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                             "return_token_strs": True})
    body = r.json()
    assert body["count"] == len("user: x\nassistant: ") and body["token_strs"][0] == "t117"


@pytest.mark.parametrize("payload, param", [
    ({}, "prompt"),
    ({"prompt": "a", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": "a", "model": "nope"}, "model"),
])
async def test_tokenize_errors(client, payload, param):
    r = await client.post("/tokenize", json=payload)
    assert 400 <= r.status_code < 500 and r.json()["error"]["param"] == param


async def test_detokenize_and_version(client):
    r = await client.post("/detokenize", json={"tokens": [1, 2]})
    assert r.json() == {"prompt": "t1t2"}
    r = await client.post("/detokenize", json={"tokens": [-1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post("/detokenize", json={"tokens": "12"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.get("/version")
    assert r.status_code == 200 and r.json()["version"]


async def test_nan_is_refused(client, engine):
    r = await client.post("/v1/completions", content=b'{"prompt": "x", "temperature": NaN}',
                          headers={"content-type": "application/json"})
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]
    assert engine.requests == []


def _echo_script(request):
    outputs = sample_outputs(request, 0, ["Hello", " world"], logprobs=True)
    first = outputs[0]
    from dataclasses import replace
    outputs[0] = replace(first, prompt_logprobs=(None, (-1.0, ((1, -1.0),)),
                                                 (-2.0, ((7, -0.1),))))
    return [accepted(request), *outputs]


async def test_echo_non_streaming_and_streaming(client, engine):
    engine.script = _echo_script
    body = {"prompt": "abc", "echo": True, "logprobs": 1}
    r = await client.post("/v1/completions", json=body)
    sent = engine.requests[0].sampling_params
    assert sent.prompt_logprobs == 1 and sent.logprobs == 1
    choice = r.json()["choices"][0]
    assert choice["text"] == "abcHello world"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["t0", "t1", "t2", "t0", "t1"]
    assert lp["token_logprobs"] == [None, -1.0, -2.0, -0.5, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][2] == {"t7": -0.1, "t2": -2.0}
    assert lp["text_offset"] == [0, 2, 3, 3, 8]  # prompt offsets capped at len("abc")
    r = await client.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert events[0]["choices"][0]["text"] == "abcHello"
    values = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    offsets = [v for e in events for v in e["choices"][0]["logprobs"]["text_offset"]]
    assert values == lp["token_logprobs"] and offsets == lp["text_offset"]


async def test_echo_without_logprobs(client, engine):
    r = await client.post("/v1/completions", json={"prompt": [5, 6], "echo": True})
    assert engine.requests[0].sampling_params.prompt_logprobs is None
    assert r.json()["choices"][0]["text"] == "t0t1t2Hello world"  # decoded accepted ids


async def test_prompts_logged_only_with_log_prompts(engine, server_config):
    import httpx

    from kvserve.api import build_app
    from kvserve.config import ServerConfig

    for log_prompts in (False, True):
        app = build_app(engine, ServerConfig(log_prompts=log_prompts))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://t") as c:
            with structlog.testing.capture_logs() as logs:
                await c.post("/v1/completions", json={"prompt": "SECRET-PROMPT"})
        text = repr(logs)
        assert ("SECRET-PROMPT" in text) == log_prompts
        assert ("Hello world" in text) == log_prompts


async def test_lone_surrogate_is_a_400_not_a_500(client) -> None:
    """JSON may escape a lone surrogate; it is not text, so it is bad input."""
    body = '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    response = await client.post("/v1/chat/completions", content=body,
                                 headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"


def _shared_echo_script(request):
    """n = 2 with echo and logprobs: sample 1's outputs come first, and only
    sample 0's first output carries the prompt's logprobs (``fan_out``)."""
    from dataclasses import replace
    second = sample_outputs(request, 1, ["Good", " day"], logprobs=True)
    first = sample_outputs(request, 0, ["Hello", " world"], logprobs=True)
    first[0] = replace(first[0], prompt_logprobs=(None, (-1.0, ((1, -1.0),)),
                                                  (-2.0, ((7, -0.1),))))
    return [accepted(request), *second, *first]


async def test_samples_share_one_prompt_scoring(client, engine):
    """Issue 47, item 4: only sample 0 scores the prompt; every choice's
    echo lists those logprobs, streamed too, though sample 1 answered first."""
    engine.script = _shared_echo_script
    body = {"prompt": "abc", "echo": True, "logprobs": 1, "n": 2}
    r = await client.post("/v1/completions", json=body)
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for choice in choices:
        assert choice["logprobs"]["token_logprobs"][:3] == [None, -1.0, -2.0]
    assert [c["text"] for c in choices] == ["abcHello world", "abcGood day"]
    r = await client.post("/v1/completions", json={**body, "stream": True})
    firsts = {}
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            choice = json.loads(line[6:])["choices"][0]
            firsts.setdefault(choice["index"], choice)
    for index in (0, 1):
        assert firsts[index]["text"].startswith("abc")
        assert firsts[index]["logprobs"]["token_logprobs"][:3] == [None, -1.0, -2.0]


def test_only_sample_zero_asks_for_the_prompts_logprobs():
    from kvserve.actors.messages import GenerateRequest
    from kvserve.actors.tokenizer import fan_out
    from kvserve.core.sampling_params import SamplingParams

    request = GenerateRequest(request_id="r", arrival_time=0.0, prompt="abc",
                              sampling_params=SamplingParams(n=4, logprobs=1,
                                                             prompt_logprobs=1))
    children = fan_out(request, (1, 2, 3))
    assert [c.sampling_params.prompt_logprobs for c in children] == [1, None, None, None]
    assert all(c.sampling_params.logprobs == 1 for c in children)
