"""Issue 25 through the official ``openai`` client against the live server:
``models.retrieve``, ``null`` for optional fields read as unset, ``best_of``
refused, a named ``tool_choice`` finishing with ``stop`` and
``parallel_tool_calls: false`` giving one call."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import MAX_MODEL_LEN, MODEL

pytestmark = pytest.mark.model

ASK = [{"role": "user", "content": "What time is it in Lisbon?"}]
CLOCK = {"type": "function", "function": {
    "name": "read_clock", "description": "The local time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
DICE = {"type": "function", "function": {
    "name": "roll_dice", "description": "Roll dice",
    "parameters": {"type": "object", "properties": {"sides": {"type": "integer"}},
                   "required": ["sides"]}}}


def test_retrieve_model(oai) -> None:
    card = oai.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_dump()["max_model_len"] == MAX_MODEL_LEN
    assert [card] == oai.models.list().data
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("acme/not-served")
    assert info.value.code == "model_not_found" and info.value.param == "model"


def test_nulls_are_unset(oai) -> None:
    chat = oai.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=3, temperature=0, n=None, logprobs=None,
        stream=None, top_logprobs=None, presence_penalty=None,
        extra_body={"min_tokens": None, "ignore_eos": None, "skip_special_tokens": None,
                    "priority": None, "include_stop_str_in_output": None})
    assert len(chat.choices) == 1 and chat.choices[0].message.content
    assert chat.choices[0].logprobs is None
    stream = oai.completions.create(model=MODEL, prompt="Lisbon is", max_tokens=3,
                                    temperature=0, echo=None, best_of=None, n=None,
                                    stream=True, stream_options={"include_usage": None})
    chunks = list(stream)
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)
    assert not "".join(c.choices[0].text for c in chunks).startswith("Lisbon")


def test_best_of_is_refused(oai) -> None:
    for kwargs in ({"best_of": 3}, {"best_of": 2, "n": 4}, {"best_of": 5, "stream": True}):
        with pytest.raises(openai.BadRequestError) as info:
            oai.completions.create(model=MODEL, prompt="Lisbon is", max_tokens=2, **kwargs)
        assert info.value.param == "best_of", kwargs
    done = oai.completions.create(model=MODEL, prompt="Lisbon is", max_tokens=2, best_of=2, n=2)
    assert len(done.choices) == 2


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.slow
def test_named_tool_choice_finishes_with_stop(oai, stream) -> None:
    kwargs = dict(model=MODEL, messages=ASK, tools=[CLOCK, DICE], max_tokens=60,
                  temperature=0, tool_choice={"type": "function",
                                              "function": {"name": "read_clock"}})
    if not stream:
        choice = oai.chat.completions.create(**kwargs).choices[0]
        names = [c.function.name for c in choice.message.tool_calls]
        finish = choice.finish_reason
    else:
        chunks = list(oai.chat.completions.create(stream=True, **kwargs))
        names = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        [finish] = finish
    assert names == ["read_clock"] and finish == "stop"


def test_parallel_tool_calls_false_gives_one_call(oai) -> None:
    """``required`` lets the model call both tools; ``parallel_tool_calls:
    false`` makes it one."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content":
                                          "Roll a 6-sided die and tell me the time in Oslo."}],
                  tools=[CLOCK, DICE], tool_choice="required", max_tokens=120, temperature=0)
    single = oai.chat.completions.create(parallel_tool_calls=False, **kwargs).choices[0]
    assert len(single.message.tool_calls) == 1 and single.finish_reason == "tool_calls"
    json.loads(single.message.tool_calls[0].function.arguments)
