"""No CPU-heavy work on the event loop (issue 11, item 5): the tokenizer actor
encodes long prompts on its thread pool with the same results and errors as
inline, drops requests aborted meanwhile; the detokenizer's decode window
stays bounded. Structural checks only (threads, outputs), never timings."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from kvserve.actors import tokenizer as tokenizer_module
from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import (AbortRequest, Deliver, GenerateRequest, OpenStream,
                                     TokenDelta, TokenizedRequest)
from kvserve.actors.stream import RequestStream
from kvserve.actors.tokenizer import TokenizerActor
from kvserve.core.sampling_params import SamplingParams
from kvserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.model

DEADLINE_S = 60.0
#: ~9,100 tokens of text (about 20,000 characters).
LONG_TEXT = " ".join(f"item {i} weighs {i * 7 % 13} kg;" for i in range(900))
MAX_MODEL_LEN = 10_000


class RecordingTokenizer:
    """Wraps the real tokenizer; records the thread of every encode and
    template call; ``gate`` (when set) holds ``encode`` until it opens; a
    chat message whose content is ``FAIL`` makes the template raise."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.calls: list[tuple[str, int, int]] = []  # (what, thread id, characters)
        self.gate: threading.Event | None = None
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def encode(self, text: str, add_special_tokens: bool = False,
               parse_special: bool = True) -> list[int]:
        self.calls.append(("encode", threading.get_ident(), len(text)))
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(DEADLINE_S), "the test never opened the gate"
        return self._tok.encode(text, add_special_tokens=add_special_tokens,
                                parse_special=parse_special)

    def apply_chat_template(self, messages, **kwargs) -> str:
        self.calls.append(("template", threading.get_ident(), 0))
        if any(m.get("content") == "FAIL" for m in messages):
            raise ValueError("boom")
        return self._tok.apply_chat_template(messages, **kwargs)

    def encode_chat(self, messages, add_generation_prompt=True, continue_final_message=False,
                    **kwargs) -> list[int]:
        """Records a template call and an encode (the real one encodes the
        template's text and each content apart; same ids here: no content
        holds a special-token string)."""
        return self.encode(self.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **kwargs))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        self.calls.append(("decode", threading.get_ident(), len(ids)))
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class Peer:
    """Stands in for the admission or detokenizer actor: records what it is sent."""

    def __init__(self) -> None:
        self.received: list = []

    def send(self, message) -> None:
        self.received.append(message)


@pytest.fixture(scope="module")
def real_tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer(default_model_path)


@pytest.fixture
def tok(real_tokenizer: Tokenizer) -> RecordingTokenizer:
    return RecordingTokenizer(real_tokenizer)


def request(request_id: str, max_tokens: int = 16, n: int = 1, seed: int | None = None,
            **inputs) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, n=n, seed=seed)
    return GenerateRequest(request_id=request_id, sampling_params=params, arrival_time=0.0,
                           **inputs)


def batch() -> list[GenerateRequest]:
    """Short and long prompts, chat, token ids, ``n > 1``, and four kinds of 400."""
    chat = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG_TEXT})
    return [
        request("short", prompt="Hello there"),
        request("long", prompt=LONG_TEXT, n=3, seed=5),
        request("chat-long", messages=chat, n=2),
        request("chat-short", messages=({"role": "user", "content": "hi"},)),
        request("ids", prompt_token_ids=tuple(range(5, 3005))),
        request("too-long-output", prompt=LONG_TEXT, max_tokens=2000),
        request("too-long-prompt", prompt=LONG_TEXT + LONG_TEXT),
        request("template-fails", messages=({"role": "user", "content": "FAIL"},)),
        request("bad-id", prompt_token_ids=(1, 10**9)),
    ]


async def run_batch(tok: RecordingTokenizer, requests: list[GenerateRequest]):
    """Tokenize ``requests`` through a ``TokenizerActor``; returns what
    admission received and each refused request's ``RequestFailed`` (as
    delivered to the detokenizer)."""
    admission, detokenizer = Peer(), Peer()
    actor = TokenizerActor(tok, MAX_MODEL_LEN, admission, detokenizer)
    actor.start()
    for r in requests:
        actor.send(r)
    await asyncio.wait_for(actor.stop(), DEADLINE_S)  # handles the inbox, then what is in flight
    assert not actor._in_flight
    failures = {m.request_id: m.event for m in detokenizer.received if isinstance(m, Deliver)}
    assert len(failures) == len(detokenizer.received)
    return admission.received, failures


def run_mode(monkeypatch, tok: RecordingTokenizer, inline: bool):
    """``run_batch`` with every prompt inline or every prompt on the pool."""
    monkeypatch.setattr(tokenizer_module, "INLINE_MAX_CHARS", 10**9 if inline else 0)

    async def main():
        return threading.get_ident(), await run_batch(tok, batch())

    return asyncio.run(main())


def by_request(received: list[TokenizedRequest]) -> dict[str, list[TokenizedRequest]]:
    grouped: dict[str, list[TokenizedRequest]] = {}
    for child in received:
        grouped.setdefault(child.parent_id, []).append(child)
    return grouped


def test_long_prompts_are_encoded_off_the_event_loop(monkeypatch, tok):
    loop_thread, (received, _) = run_mode(monkeypatch, tok, inline=False)
    heavy = [(what, thread) for what, thread, chars in tok.calls
             if what == "template" or chars > 1000]
    assert {what for what, _ in heavy} == {"encode", "template"}
    assert all(thread != loop_thread for _, thread in heavy)
    assert by_request(received)["long"][0].prompt_token_ids == tuple(tok._tok.encode(LONG_TEXT))


def test_short_prompts_stay_inline_by_default(tok):
    async def main():
        await run_batch(tok, [request("short", prompt="Hello there")])
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert [(what, thread) for what, thread, _ in tok.calls] == [("encode", loop_thread)]


def test_offloaded_results_and_errors_match_inline(monkeypatch, tok):
    _, (inline_received, inline_failures) = run_mode(monkeypatch, tok, inline=True)
    _, (pooled_received, pooled_failures) = run_mode(monkeypatch, tok, inline=False)
    assert pooled_failures == inline_failures
    assert {rid: (f.status, f.param) for rid, f in pooled_failures.items()} == {
        "too-long-output": (400, "max_tokens"), "too-long-prompt": (400, "prompt"),
        "template-fails": (400, "messages"), "bad-id": (400, "prompt")}
    assert by_request(pooled_received) == by_request(inline_received)
    assert set(by_request(pooled_received)) == {"short", "long", "chat-long", "chat-short", "ids"}


def test_samples_of_a_request_stay_together_and_in_order(monkeypatch, tok):
    _, (received, _) = run_mode(monkeypatch, tok, inline=False)
    parents = [child.parent_id for child in received]
    for parent, children in by_request(received).items():
        first = parents.index(parent)
        assert parents[first:first + len(children)] == [parent] * len(children)
        assert [c.index for c in children] == list(range(len(children)))
    seeds = [c.sampling_params.seed for c in by_request(received)["long"]]
    assert seeds == [5, 6, 7]


@pytest.mark.parametrize("reuse_id", [False, True])
def test_abort_while_tokenizing_leaks_nothing(tok, reuse_id):
    """The request is aborted (and its id maybe reused at once) while its
    prompt is on the pool: nothing of it reaches admission or the
    detokenizer; the new request with the same id is admitted."""
    tok.gate = threading.Event()

    async def main():
        admission, detokenizer = Peer(), Peer()
        actor = TokenizerActor(tok, MAX_MODEL_LEN, admission, detokenizer)
        actor.start()
        actor.send(request("a", prompt=LONG_TEXT, n=2))
        assert await asyncio.to_thread(tok.entered.wait, DEADLINE_S)
        assert actor._in_flight
        actor.send(AbortRequest(("a-0", "a-1")))  # what AsyncEngine.abort sends
        if reuse_id:
            actor.send(request("a", prompt=LONG_TEXT[:5000]))
        await asyncio.sleep(0)
        tok.gate.set()
        await asyncio.wait_for(actor.stop(), DEADLINE_S)
        assert not actor._in_flight and not actor._preparing and not actor._aborted
        assert detokenizer.received == [] and admission.received == [] if not reuse_id else [
            (m.request_id, len(m.prompt_token_ids)) for m in admission.received] == [
            ("a", len(tok._tok.encode(LONG_TEXT[:5000])))]

    asyncio.run(main())


def stream_events(stream: RequestStream) -> list:
    """The events written to ``stream`` so far."""
    events = []
    while not stream._queue.empty():
        events.append(stream._queue.get_nowait())
    return events


def test_detokenizer_window_stays_bounded_over_special_tokens(tok):
    """A run of skipped special tokens used to keep the decode window from
    advancing (O(run) per step); now every decode sees a few tokens only."""
    text_ids = tok._tok.encode(LONG_TEXT)[:300]
    special = tok._tok.all_special_ids[1]
    ids = text_ids[:150] + [special] * 600 + text_ids[150:]
    detok = DetokenizerActor(tok, Peer())
    stream = RequestStream("r", 1)
    params = SamplingParams(max_tokens=2000, stop=["never appears"])

    async def main():
        await detok.handle(OpenStream("r", 1, stream))
        await detok.handle(TokenizedRequest(request_id="r", parent_id="r", index=0,
                                            prompt_token_ids=(1,), sampling_params=params,
                                            arrival_time=0.0))
        tok.calls.clear()
        for i, token_id in enumerate(ids):
            await detok.handle(TokenDelta(
                "r", (token_id,), finish_reason="length" if i == len(ids) - 1 else None))

    asyncio.run(main())
    windows = [size for what, _, size in tok.calls if what == "decode"]
    assert windows and max(windows) <= 8
    outputs = stream_events(stream)
    assert "".join(o.text for o in outputs) == tok._tok.decode(ids)
    assert sum(len(o.token_ids) for o in outputs) == len(ids)
    assert outputs[-1].finish_reason == "length"


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(tok):
    """Issue 14, item 2: more characters than max_model_len tokens can hold
    (at most ``max_token_bytes`` characters each) is a 400 before any encode
    or template call."""
    bound = MAX_MODEL_LEN * tok.max_token_bytes
    huge = "a" * (bound + 1)
    received, failures = asyncio.run(run_batch(tok, [
        request("huge", prompt=huge),
        request("huge-chat", messages=({"role": "user", "content": huge},))]))
    assert received == []
    assert failures["huge"].status == 400 and failures["huge"].param == "prompt"
    assert failures["huge-chat"].param == "messages"
    assert "can hold" in failures["huge"].message
    assert not [c for c in tok.calls if c[0] in ("encode", "template")], tok.calls


def test_chat_template_kwargs_reach_the_template(tok):
    """A chat request's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``)
    are the template's variables when the tokenizer actor renders it."""
    seen = []
    render = tok.apply_chat_template
    tok.apply_chat_template = lambda messages, **kw: seen.append(kw) or render(messages, **kw)
    received, failures = asyncio.run(run_batch(tok, [
        request("kw", messages=({"role": "user", "content": "hi"},),
                chat_template_kwargs={"enable_thinking": False}),
        request("plain", messages=({"role": "user", "content": "hi"},))]))
    assert not failures and len(received) == 2
    seen = [{k: v for k, v in kw.items() if k not in ("add_generation_prompt", "render_budget_s")}
            for kw in seen]
    assert sorted(seen, key=len) == [{}, {"enable_thinking": False}]  # any order

