"""A sample the engine failed (a step raised) ends its client's request with a
500 error event that says why, not a silent ``finish_reason: "error"``; the
request's other samples are aborted."""

import asyncio

from actor_support import Inbox

from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import (AbortRequest, OpenStream, RequestFailed, RequestOutput,
                                     TokenDelta, TokenizedRequest)
from kvserve.actors.stream import RequestStream
from kvserve.core.sampling_params import SamplingParams


class ByteTokenizer:
    """Token id i decodes to chr(i)."""

    all_special_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def events(stream):
    async def drain():
        return [event async for event in stream]
    return asyncio.run(drain())


def open_stream(actor, request_id: str, n: int) -> RequestStream:
    """What the engine does: open the request's stream at the detokenizer."""
    stream = RequestStream(request_id, n)
    asyncio.run(actor.handle(OpenStream(request_id, n, stream)))
    return stream


def setup(n: int):
    actor = DetokenizerActor(ByteTokenizer(), Inbox())
    stream = open_stream(actor, "r", n)
    ids = ["r"] if n == 1 else [f"r-{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        asyncio.run(actor.handle(TokenizedRequest(rid, "r", i, (1, 2), SamplingParams(),
                                                  arrival_time=0.0)))
    return actor, stream, ids


def test_a_failed_step_ends_the_request_with_a_500_that_says_why() -> None:
    actor, stream, _ = setup(1)
    asyncio.run(actor.handle(TokenDelta("r", (72,), None, num_prompt_tokens=2)))
    asyncio.run(actor.handle(TokenDelta("r", (), "error", num_prompt_tokens=2,
                                        error="RuntimeError: CUDA error")))
    got = events(stream)
    assert isinstance(got[0], RequestOutput) and got[0].text == "H"
    assert isinstance(got[-1], RequestFailed)
    assert got[-1].status == 500 and got[-1].type == "server_error"
    assert "RuntimeError: CUDA error" in got[-1].message
    assert not actor.streams.is_open("r")
    assert actor.admission.messages == []


def test_a_failed_sample_aborts_its_siblings() -> None:
    actor, stream, ids = setup(3)
    asyncio.run(actor.handle(TokenDelta("r-1", (), "error", num_prompt_tokens=2,
                                        error="InjectedFault: step 4")))
    got = events(stream)
    assert [type(e) for e in got] == [RequestFailed]
    (abort,) = actor.admission.messages
    assert isinstance(abort, AbortRequest) and set(abort.request_ids) == {"r-0", "r-2"}
