"""Logprobs on the wire are finite (issue 14, item 3): a probability-0
token (log-softmax -inf, e.g. masked by top-k) is shown as -9999, vLLM's
floor, and the event encoders refuse NaN and Infinity instead of writing
invalid JSON."""

from __future__ import annotations

import json
import math

import pytest

from kvserve.api.rendering import MIN_LOGPROB, chat_logprobs, completion_logprobs
from kvserve.api.serving import json_in_pieces, sse

NEG_INF = -math.inf
ENTRIES = [(-0.5, ((7, -0.5), (8, NEG_INF))), (NEG_INF, ((9, -0.1), (10, NEG_INF)))]


def test_completion_logprobs_floor_minus_infinity():
    out = completion_logprobs(ENTRIES, [7, 10], [0, 1], token_text=lambda t: f"t{t}")
    assert out["token_logprobs"] == [-0.5, MIN_LOGPROB]
    assert out["top_logprobs"] == [{"t7": -0.5, "t8": MIN_LOGPROB},
                                   {"t9": -0.1, "t10": MIN_LOGPROB}]
    json.loads(sse(out).decode().removeprefix("data: "), parse_constant=_refuse)


def test_chat_logprobs_floor_minus_infinity():
    out = chat_logprobs(ENTRIES, [7, 10], token_text=lambda t: f"t{t}",
                        token_bytes=lambda t: b"x", top_n=2)
    values = [out["content"][1]["logprob"]] + [
        alt["logprob"] for item in out["content"] for alt in item["top_logprobs"]]
    assert values == [MIN_LOGPROB, -0.5, MIN_LOGPROB, -0.1, MIN_LOGPROB]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_the_encoders_refuse_non_finite_numbers(bad):
    with pytest.raises(ValueError, match="Out of range float"):
        sse({"logprob": bad})
    with pytest.raises(ValueError, match="Out of range float"):
        json_in_pieces({"values": [0.0] * 5 + [bad]})
    with pytest.raises(ValueError, match="Out of range float"):
        sse({"values": [0.0] * 5 + [bad]}, large=True)


def _refuse(constant: str):
    raise AssertionError(f"non-JSON number {constant}")
