"""Large renders leave the event loop (issue 11, item 5): a completions
``echo`` with logprobs over a long prompt is rendered on a worker thread,
with the same bytes as when rendered inline. Structural checks only."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import httpx
import pytest
from fake_engine import FakeEngine, FakeTokenizer, accepted, sample_outputs

from kvserve.api import build_app, serving
from kvserve.config import ServerConfig



NUM_PROMPT = 600  # > serving.OFFLOAD_MIN_LOGPROB_TOKENS


class RecordingTokenizer(FakeTokenizer):
    """Records the thread of every ``decode`` (token texts, echoed prompts)."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.get_ident())
        return super().decode(ids, skip_special_tokens)


def long_echo_script(request):
    outputs = sample_outputs(request, 0, ["Hello", " world"], logprobs=True,
                             num_prompt=NUM_PROMPT)
    prompt_logprobs = (None,) + tuple((-1.0, ((t + 1, -0.5), (t + 2, -1.5)))
                                      for t in range(1, NUM_PROMPT))
    outputs[0] = replace(outputs[0], prompt_logprobs=prompt_logprobs)
    return [accepted(request, NUM_PROMPT), *outputs]


async def post_both(tokenizer: RecordingTokenizer) -> tuple[dict, list[dict]]:
    """A non-streamed and a streamed echo request; their parsed bodies."""
    engine = FakeEngine(long_echo_script)
    engine.tokenizer = tokenizer
    app = build_app(engine, ServerConfig())
    body = {"prompt": list(range(NUM_PROMPT)), "echo": True, "logprobs": 2}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]
    for part in [whole, *chunks]:
        part.pop("id"), part.pop("created")
    return whole, chunks


@pytest.mark.anyio
async def test_long_echo_with_logprobs_renders_off_the_loop(monkeypatch):
    loop_thread = threading.get_ident()
    tokenizer = RecordingTokenizer()
    pooled = await post_both(tokenizer)
    on_loop = tokenizer.threads.count(loop_thread)  # the 2 output tokens' texts, a few times
    assert on_loop <= 12 and len(tokenizer.threads) - on_loop >= NUM_PROMPT
    monkeypatch.setattr(serving, "OFFLOAD_MIN_LOGPROB_TOKENS", 10**9)
    inline = await post_both(RecordingTokenizer())
    assert pooled == inline
    whole, chunks = pooled
    assert len(whole["choices"][0]["logprobs"]["tokens"]) == NUM_PROMPT + 2
    assert len(chunks[0]["choices"][0]["logprobs"]["tokens"]) == NUM_PROMPT + 1


@pytest.mark.parametrize("ensure_ascii", [True, False])
def test_json_in_pieces_is_json_dumps(ensure_ascii):
    entry = {"token": "é\u2028\"x", "logprob": -0.25, "bytes": [195, 169], "top": None}
    value = {"a": [entry] * 1000, "b": {"c": list(range(257)), "d": [[1.5, True]] * 3},
             "e": (), "f": {}, "g": [{"h": [entry] * 300}], "k": {1: "non-str key"}}
    expected = json.dumps(value, separators=(",", ":"), ensure_ascii=ensure_ascii)
    assert serving.json_in_pieces(value, ensure_ascii=ensure_ascii) == expected


def test_json_in_pieces_refuses_nan_like_json_dumps():
    with pytest.raises(ValueError):
        serving.json_in_pieces({"x": [float("nan")] * 300}, allow_nan=False)
