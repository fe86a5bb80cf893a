"""Acceptance (issue 15, tool calling), through the official ``openai``
client against the live server: ``tool_choice: "required"`` and a named
function always give parseable ``tool_calls`` whose arguments validate
against the tool's schema (``jsonschema``), greedy and sampled, streamed
and not; ``none`` gives none; the history (an assistant's calls, a tool's
result, a ``developer`` message) renders through the template.

``auto`` leaves the model free and parses its answer. Asked cold, the
default 135M model answers in prose (the parser behind ``auto`` is also
tested without a model, ``tests/api/test_api_tools.py``); in a conversation
where the assistant already answered a question of the same kind with a
call, it calls the tool again for the next one, and ``auto`` returns that
call in OpenAI's shape.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.model

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 20}},
                   "required": ["tz"]}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture
def client(live_server):
    return openai.OpenAI(base_url=f"{live_server.base_url}/v1", api_key="unused",
                         timeout=300, max_retries=0)


def calls_of(client, stream: bool, **kwargs) -> tuple[list[tuple[str, dict]], str]:
    """``[(name, arguments)]`` and the finish reason, read the client's way."""
    kwargs = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 80, **kwargs}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = choice.message.tool_calls or []
        return ([(c.function.name, json.loads(c.function.arguments)) for c in calls],
                choice.finish_reason)
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or () if chunk.choices else ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    return ([(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())],
            finish)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("choice", ["required", "get_time"])
@pytest.mark.slow
def test_forced_tool_calls_always_parse_and_validate(client, stream, temperature, choice):
    tool_choice = choice if choice == "required" else {"type": "function",
                                                       "function": {"name": choice}}
    for seed in range(2 if temperature else 1):
        calls, finish = calls_of(client, stream, tool_choice=tool_choice,
                                 temperature=temperature, seed=seed)
        # a named function finishes with "stop", as in OpenAI's API and vLLM
        assert calls and finish == ("tool_calls" if choice == "required" else "stop"), \
            (calls, finish)
        for name, arguments in calls:
            assert choice == "required" or name == choice
            jsonschema.validate(arguments, SCHEMAS[name])


@pytest.mark.slow
def test_a_forced_answer_cut_by_max_tokens_has_no_content(client) -> None:
    """``required`` lets the model call each tool; at 64 tokens its second
    call is cut off: the first comes back as a call, the cut one is dropped
    rather than returned as ``<tool_call>`` text."""
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                  max_tokens=64, temperature=0.0)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    content = [chunk.choices[0].delta.content
               for chunk in client.chat.completions.create(stream=True, **kwargs)
               if chunk.choices and chunk.choices[0].delta.content]
    assert content == []


def test_tool_choice_none_gives_no_calls(client) -> None:
    calls, finish = calls_of(client, False, tool_choice="none", temperature=0.0)
    assert calls == [] and finish in ("stop", "length")


def test_auto_answers_and_parses(client) -> None:
    response = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                              max_tokens=30, temperature=0.0)
    message = response.choices[0].message
    assert message.content or message.tool_calls


#: A conversation that calls for a tool: the assistant answered the same
#: kind of question with a call (its result not back yet), and the user asks
#: the next one.
FOLLOW_UP = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
    "id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "user", "content": "What is the weather like in London?"}]


@pytest.mark.parametrize("stream", [False, True])
def test_auto_calls_the_tool_when_the_conversation_calls_for_it(client, stream) -> None:
    calls, finish = calls_of(client, stream, messages=FOLLOW_UP, tool_choice="auto",
                             temperature=0.0)
    assert calls == [("get_weather", {"city": "London"})] and finish == "tool_calls"
    jsonschema.validate(calls[0][1], SCHEMAS["get_weather"])


def test_history_with_calls_results_and_developer_renders(http) -> None:
    messages = [{"role": "developer", "content": "Be brief."}, *ASK,
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function", "function": {
                        "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    tokens = http.post("/tokenize", json={"messages": messages, "return_token_strs": True})
    assert tokens.status_code == 200, tokens.text
    prompt = "".join(tokens.json()["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
    assert "<tool_call>" in prompt and "<tool_response>" in prompt
    assert "You are a helpful AI assistant" not in prompt  # developer took the system role
    response = http.post("/v1/chat/completions", json={
        "messages": messages, "tools": TOOLS, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
