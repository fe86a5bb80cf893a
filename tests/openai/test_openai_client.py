"""The official ``openai`` Python client, unmodified, against a live server:
chat and completions, streamed and not, with ``stream_options``,
``logprobs``, ``seed``, ``stop`` and ``n``; plus ``echo``, ``/tokenize``,
``/detokenize`` and ``/version``."""

from __future__ import annotations

import math

import pytest
from conftest import MODEL

pytestmark = pytest.mark.model

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def test_chat_non_streaming(oai) -> None:
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=2, n=2,
                                       seed=1)
    assert chat.object == "chat.completion" and len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    for choice in chat.choices:
        assert choice.message.role == "assistant" and choice.message.content
        assert choice.finish_reason in ("stop", "length")
        content = choice.logprobs.content
        assert content and all(len(e.top_logprobs) == 2 for e in content)
        assert all(e.logprob <= 0 for e in content)
    assert chat.usage.completion_tokens == sum(len(c.logprobs.content) for c in chat.choices)
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens


def test_chat_streaming_with_usage_and_stop(oai) -> None:
    full = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       temperature=0).choices[0].message.content
    stop = full.split()[1] if len(full.split()) > 1 else full[-2:]
    stream = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                         temperature=0, stop=[stop], stream=True,
                                         stream_options={"include_usage": True}, logprobs=True)
    text, usage, finish, roles, usage_chunks = "", None, None, [], 0
    for chunk in stream:
        if chunk.usage is not None:
            usage_chunks += 1
            usage = chunk.usage
            assert chunk.choices == []
            continue
        delta = chunk.choices[0].delta
        if delta.role:
            roles.append(delta.role)
        text += delta.content or ""
        finish = chunk.choices[0].finish_reason or finish
    assert roles == ["assistant"] and usage_chunks == 1
    assert text == full[:full.index(stop)]
    assert finish == "stop"
    assert usage.completion_tokens >= 1 and usage.prompt_tokens_details.cached_tokens >= 0


def test_completions_non_streaming_and_streaming(oai) -> None:
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  logprobs=2)
    choice = done.choices[0]
    assert done.object == "text_completion" and choice.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == choice.text
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=2, stream=True,
                                    stream_options={"include_usage": True})
    text, logprobs, usage = "", [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            if c.logprobs:
                logprobs += c.logprobs.token_logprobs
    assert text == choice.text and logprobs == lp.token_logprobs
    assert usage.completion_tokens == 6


def test_seeded_sampling_n(oai) -> None:
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=123, n=3)
    first = oai.completions.create(**kwargs)
    second = oai.completions.create(**kwargs)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert len({c.text for c in first.choices}) > 1  # seed + i per sample


def test_echo_with_prompt_logprobs(oai, http) -> None:
    done = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                  logprobs=1, echo=True)
    choice = done.choices[0]
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                   logprobs=1)
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    # the same values as without echo (up to float noise: more LM-head rows in the batch)
    assert lp.token_logprobs[n:] == pytest.approx(plain.choices[0].logprobs.token_logprobs,
                                                  abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(PROMPT)
    assert lp.text_offset == sorted(lp.text_offset)
    # each prompt logprob is a proper log-probability of a top-1 list
    for top, value in zip(lp.top_logprobs[1:n], lp.token_logprobs[1:n]):
        assert max(top.values()) >= value - 1e-6 and math.isfinite(value)
    # streamed echo: the prompt comes first, logprobs are the same
    stream = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logprobs=1, echo=True, stream=True)
    text, values = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.text
            values += c.logprobs.token_logprobs if c.logprobs else []
    assert text == choice.text and values == lp.token_logprobs


def test_token_id_prompt(oai, http) -> None:
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    by_ids = oai.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    nested = http.post("/v1/completions", json={"prompt": [ids], "max_tokens": 4,
                                                "temperature": 0})
    assert nested.status_code == 200 and nested.json()["choices"][0]["text"] == \
        by_text.choices[0].text
    batch = http.post("/v1/completions", json={"prompt": [ids, ids], "max_tokens": 4})
    assert batch.status_code == 400 and batch.json()["error"]["param"] == "prompt"


def test_tokenize_detokenize_version(http) -> None:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 512
    r = http.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    usage = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}
                      ).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    r = http.get("/version")
    assert r.status_code == 200 and r.json()["version"]
    assert http.post("/detokenize", json={"tokens": [10**9]}).json()["error"]["param"] == "tokens"


def test_responses_api_on_the_real_model(oai) -> None:
    """``/v1/responses`` end to end on the default model: greedy, the same
    text as the chat completion of the same messages, usage that adds up,
    and streamed events whose deltas make the final text."""
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in one word."},
                               {"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8, temperature=0)
    r = oai.responses.create(model=MODEL, instructions="Answer in one word.",
                             input="What is the capital of France?", max_output_tokens=8,
                             temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    with oai.responses.stream(model=MODEL, instructions="Answer in one word.",
                              input="What is the capital of France?", max_output_tokens=8,
                              temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text
