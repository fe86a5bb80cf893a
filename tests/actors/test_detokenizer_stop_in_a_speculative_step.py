"""A stop string completed by one token of a multi-token delta (a
speculative step accepts several tokens at once): the output keeps the
tokens up to that one, as plain decoding would have -- text, token ids,
``num_output_tokens`` (the response's ``usage``) and the count the
detokenizer hands the scheduler for the lifecycle log."""

import asyncio

from test_detokenizer_errors import ByteTokenizer, events, open_stream

from actor_support import Inbox
from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import AbortRequest, RequestOutput, TokenDelta, TokenizedRequest
from kvserve.core.sampling_params import SamplingParams


def run(stop, include, deltas):
    actor = DetokenizerActor(ByteTokenizer(), Inbox())
    stream = open_stream(actor, "r", 1)
    params = SamplingParams(stop=stop, include_stop_str_in_output=include)
    asyncio.run(actor.handle(TokenizedRequest("r", "r", 0, (1, 2), params, arrival_time=0.0)))
    for tokens in deltas:
        asyncio.run(actor.handle(TokenDelta("r", tuple(ord(c) for c in tokens), None,
                                            num_prompt_tokens=2)))
    outputs = [e for e in events(stream) if isinstance(e, RequestOutput)]
    return outputs, actor.admission.messages


def test_tokens_after_the_stop_in_the_same_delta_are_not_output() -> None:
    outputs, messages = run(["cd"], False, ["ab", "cdefg"])
    assert "".join(o.text for o in outputs) == "ab"
    assert sum(len(o.token_ids) for o in outputs) == 4  # a b c d: d completed the stop
    assert outputs[-1].finish_reason == "stop" and outputs[-1].num_output_tokens == 4
    (abort,) = messages
    assert isinstance(abort, AbortRequest) and abort.reason == "stop"
    assert abort.num_output_tokens == (4,)


def test_the_same_counts_as_one_token_per_delta() -> None:
    speculative, _ = run(["cd"], True, ["ab", "cdefg"])
    plain, _ = run(["cd"], True, ["a", "b", "c", "d", "e"])
    for outputs in (speculative, plain):
        assert "".join(o.text for o in outputs) == "abcd"
        assert outputs[-1].num_output_tokens == 4
        assert [t for o in outputs for t in o.token_ids] == [ord(c) for c in "abcd"]
