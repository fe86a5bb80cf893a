"""``kvserve.api.tool_calls``: the Hermes tool-call format without a model: the
parser (Hermes objects, SmolLM2 lists, malformed blocks left as text), the
streaming splitter (a tag cut anywhere), history rendering and the grammar
of forced calls (checked by llguidance's matcher on hand-written answers);
through the app on scripted answers, ``parallel_tool_calls: false`` and the
finish reason of a named ``tool_choice`` (issue 25)."""

from __future__ import annotations

import json

import llguidance
import pytest
from fake_engine import accepted, sample_outputs

from kvserve.api.protocol import ChatCompletionRequest
from kvserve.api.tool_calls import ToolCallStream, parse_tool_calls, render_messages, tool_grammar
from kvserve.constraints.grammar import to_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def names_and_args(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_parse_hermes_and_smollm_list_forms() -> None:
    content, calls = parse_tool_calls(f"Sure.\n{CALL}")
    assert content == "Sure." and names_and_args(calls) == [("get_weather", {"city": "Paris"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    listed = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]' \
             '</tool_call>'
    content, calls = parse_tool_calls(listed)
    assert content is None and names_and_args(calls) == [("a", {}), ("b", {"x": 1})]


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{"])
def test_text_without_a_well_formed_call_is_content(text: str) -> None:
    assert parse_tool_calls(text) == (text, [])


@pytest.mark.parametrize("cut", range(1, len(CALL) + 6, 3))
def test_stream_splitter_holds_back_a_tag_cut_anywhere(cut: int) -> None:
    text = f"Hi <{CALL}\n{CALL.replace('Paris', 'Oslo')} bye"
    stream, content, calls = ToolCallStream(), [], []
    for start in range(0, len(text), cut):
        piece, done = stream.feed(text[start:start + cut])
        content.append(piece)
        calls += done
    rest, last = stream.finish()
    content.append(rest)
    assert "".join(content) == "Hi <\n bye" and last == []
    assert [a["city"] for _, a in names_and_args(calls)] == ["Paris", "Oslo"]


def test_history_is_rendered_for_a_chatml_template() -> None:
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    out = render_messages(messages, [WEATHER])
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and "<tools>" in out[0]["content"]
    assert '"name": "get_weather"' in out[2]["content"] and "<tool_call>" in out[2]["content"]
    assert out[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'
    assert render_messages(messages[:2], None)[0] == {"role": "system", "content": "Be brief."}


def matcher_accepts(grammar: str, text: str, tokenizer) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.fixture(scope="module")
def byte_tokenizer(default_model_path):
    return llguidance.LLTokenizer(str(default_model_path / "tokenizer.json"))


@pytest.mark.model
def test_required_grammar_allows_only_calls_whose_arguments_fit(byte_tokenizer) -> None:
    grammar = to_grammar(tool_grammar([WEATHER, TIME], None, parallel=True))
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
    assert matcher_accepts(grammar, CALL, byte_tokenizer)
    assert matcher_accepts(grammar, f"{CALL}\n{time_call}", byte_tokenizer)
    assert not matcher_accepts(grammar, "Sure!", byte_tokenizer)
    assert not matcher_accepts(grammar, CALL.replace('"city"', '"town"'), byte_tokenizer)
    single = to_grammar(tool_grammar([WEATHER, TIME], None, parallel=False))
    assert not matcher_accepts(single, f"{CALL}\n{time_call}", byte_tokenizer)
    named = to_grammar(tool_grammar([WEATHER, TIME], "get_time", parallel=True))
    assert matcher_accepts(named, time_call, byte_tokenizer)
    assert not matcher_accepts(named, CALL, byte_tokenizer)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **fields})


@pytest.mark.parametrize("fields, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "no tool is named"),
    ({"tool_choice": "required", "tools": None}, "needs tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
])
def test_bad_tool_choices_name_the_field(fields: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words) as info:
        request(**fields).sampling_params()
    assert str(info.value).startswith("tool_choice")


def test_none_and_auto_leave_sampling_free() -> None:
    assert request(tool_choice="none").sampling_params().structured_outputs is None
    assert request().sampling_params().structured_outputs is None
    assert request(tool_choice="required").sampling_params().structured_outputs is not None
    assert not request(tool_choice="none").tools_active and request().tools_active


def test_strict_schemas_close_every_object() -> None:
    from kvserve.core.structured_outputs import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "string"}}},
        "c": {"type": "array", "items": {"properties": {"d": {"type": "integer"}}}},
        "e": {"type": "object", "additionalProperties": True}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["e"]["additionalProperties"] is True  # said otherwise
    assert "additionalProperties" not in schema  # a copy
    strict = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                   "strict": True}}})
    assert strict.sampling_params().structured_outputs.schema() == closed


# ------------------------------------------------- through the app, with a scripted answer

TZ_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}\n</tool_call>'
LIMA_CALL = CALL.replace("Paris", "Lima")
TWO_CALLS = ["Checking both.", f"\n{TZ_CALL[:23]}", TZ_CALL[23:], f"\n{LIMA_CALL}"]


def answering(pieces: list[str], finish: str = "stop"):
    """A ``FakeEngine`` script whose one sample is ``pieces`` (one token each)."""
    return lambda req: [accepted(req), *sample_outputs(req, 0, pieces, finish=finish)]


async def chat(client, engine, pieces: list[str], stream: bool, finish: str = "stop",
               **fields) -> tuple[str | None, list[tuple[str, dict]], str]:
    """``(content, [(name, arguments)], finish_reason)`` of a chat answer
    ``pieces`` with ``tools=[WEATHER, TIME]``, streamed chunks assembled by
    ``index`` as a client does."""
    engine.script = answering(pieces, finish)
    body = {"messages": [{"role": "user", "content": "Time in Tokyo, weather in Lima?"}],
            "tools": [WEATHER, TIME], "stream": stream, **fields}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        [choice] = r.json()["choices"]
        message = choice["message"]
        return (message["content"], names_and_args(message.get("tool_calls") or []),
                choice["finish_reason"])
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    content, calls, finish_reason = "", {}, None
    for chunk in chunks:
        [choice] = chunk["choices"]
        content += choice["delta"].get("content") or ""
        for item in choice["delta"].get("tool_calls") or ():
            assert item["index"] not in calls, "a call is streamed once, whole"
            calls[item["index"]] = item
        finish_reason = choice["finish_reason"] or finish_reason
    return content, names_and_args([calls[i] for i in sorted(calls)]), finish_reason


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_parallel_tool_calls_false_returns_only_the_first_call(client, engine, stream):
    """OpenAI's ``parallel_tool_calls: false``: at most one call. As vLLM
    (``maybe_filter_parallel_tool_calls``) the first call is kept, later ones
    are dropped (streamed: only ``index`` 0), the content is untouched."""
    content, calls, finish = await chat(client, engine, TWO_CALLS, stream,
                                        parallel_tool_calls=False, tool_choice="auto")
    assert calls == [("get_time", {"tz": "Asia/Tokyo"})]
    assert content.strip() == "Checking both." and finish == "tool_calls"
    _, both, _ = await chat(client, engine, TWO_CALLS, stream, parallel_tool_calls=True)
    assert [name for name, _ in both] == ["get_time", "get_weather"]


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_a_named_tool_choice_finishes_with_stop(client, engine, stream):
    """A named function answers ``finish_reason: "stop"`` (OpenAI, vLLM's
    ``resolve_finish_reason``); ``required`` and ``auto`` say ``tool_calls``;
    a call cut off stays ``length``."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    content, calls, finish = await chat(client, engine, [LIMA_CALL[:30], LIMA_CALL[30:]],
                                        stream, tool_choice=named)
    assert calls == [("get_weather", {"city": "Lima"})] and finish == "stop"
    assert not content
    for choice in ("required", "auto"):
        _, calls, finish = await chat(client, engine, [LIMA_CALL], stream, tool_choice=choice)
        assert len(calls) == 1 and finish == "tool_calls"
    _, calls, finish = await chat(client, engine, [LIMA_CALL[:30]], stream, finish="length",
                                  tool_choice=named)
    assert calls == [] and finish == "length"


#: Issue 48, item 2: nested pydantic models give ``$defs`` and ``#/$defs`` pointers.
NESTED = {"type": "function", "function": {"name": "save", "parameters": {
    "type": "object", "properties": {"home": {"$ref": "#/$defs/Address"}}, "required": ["home"],
    "$defs": {"Address": {"type": "object", "properties": {"country": {"$ref": "#/$defs/Country"}},
                          "required": ["country"]},
              "Country": {"type": "object", "properties": {"code": {"type": "string"}},
                          "required": ["code"]}}}}}
RECURSIVE = {"type": "function", "function": {"name": "grow", "parameters": {
    "type": "object", "properties": {"root": {"$ref": "#/definitions/Node"}}, "required": ["root"],
    "definitions": {"Node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/Node"}}},
        "required": ["v", "kids"]}}}}}


def test_nested_definitions_move_to_the_grammars_root() -> None:
    """Each function's ``$defs`` / ``definitions`` go to the root of the
    forced call's schema (prefixed by the function), and its pointers follow."""
    params = tool_grammar([NESTED, RECURSIVE], None, parallel=True)
    schema = json.loads(params.grammar.split("%json ", 1)[1].splitlines()[0])
    assert set(schema["$defs"]) == {"f0_Address", "f0_Country", "f1_Node"}
    assert schema["$defs"]["f0_Address"]["properties"]["country"]["$ref"] == "#/$defs/f0_Country"
    assert schema["$defs"]["f1_Node"]["properties"]["kids"]["items"]["$ref"] == "#/$defs/f1_Node"
    first, second = (call["properties"]["arguments"] for call in schema["anyOf"])
    assert first["properties"]["home"]["$ref"] == "#/$defs/f0_Address" and "$defs" not in first
    assert second["properties"]["root"]["$ref"] == "#/$defs/f1_Node"


@pytest.mark.model
@pytest.mark.parametrize("tool, answer", [
    (NESTED, '{"name": "save", "arguments": {"home": {"country": {"code": "FR"}}}}'),
    (RECURSIVE, '{"name": "grow", "arguments": {"root": {"v": 1, "kids": [{"v": 2, "kids": []}]}}}'),
])
def test_a_forced_call_with_nested_models_compiles_and_fits(byte_tokenizer, tool, answer):
    """``tool_choice`` forced on a function whose parameters are nested
    pydantic models (two deep, or recursive): the grammar compiles (it was
    a 400, ``Pointer '/$defs/Country' does not exist``) and accepts a
    fitting call, not a wrong one."""
    name = tool["function"]["name"]
    grammar = to_grammar(tool_grammar([tool], name, parallel=False))
    assert matcher_accepts(grammar, f"<tool_call>\n{answer}\n</tool_call>", byte_tokenizer)
    wrong = answer.replace('"FR"', "7").replace('"v": 2', '"v": "two"')
    assert not matcher_accepts(grammar, f"<tool_call>\n{wrong}\n</tool_call>", byte_tokenizer)
