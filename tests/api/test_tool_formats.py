"""Tool-call formats of each family (``--tool-call-parser``, vLLM's names):
Hermes (Qwen), ``llama3_json`` (Llama 3.x), ``mistral`` and
``phi4_mini_json``, from the chat template's markers or the flag: answers
written by hand as each family writes them are parsed whole and streamed
(any cut), a forced choice's grammar (checked by llguidance's matcher)
accepts exactly the format, and, through the official ``openai`` client, a
Qwen-style and a Llama-3-style template get the tools as their ``tools``
variable and the answer comes back as parsed ``tool_calls``, streamed and
not.
"""

from __future__ import annotations

import json

import httpx
import llguidance
import openai
import pytest
from fake_engine import FakeEngine, accepted, sample_outputs

from kvserve.api import build_app
from kvserve.api.tool_calls import (FORMATS, ToolCallStream, parse_tool_calls, render_messages,
                                    resolve_format, tool_grammar)
from kvserve.config import ServerConfig
from kvserve.constraints.grammar import to_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ANSWERS = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    "mistral": 'Let me check. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": '
               '"Paris"}}]',
    "phi4_mini_json": 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    "hermes": 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>',
}
CONTENT = {"llama3_json": None, "mistral": "Let me check.", "phi4_mini_json": None,
           "hermes": "Let me check."}
#: Abridged from the published templates: how each marks its tool calls.
LLAMA3_TEMPLATE = ("{% if tools %}Environment: ipython\n{% for t in tools %}{{ t | tojson }}\n"
                   "{% endfor %}{% endif %}{% for m in messages %}<|start_header_id|>"
                   "{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n")
QWEN_TEMPLATE = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>\n{% for t in tools %}"
                 "{{ t | tojson }}\n{% endfor %}</tools>\nFor each function call, return "
                 "<tool_call></tool_call> XML tags.<|im_end|>\n{% endif %}{% for m in messages %}"
                 "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                 "<|im_start|>assistant\n")


def calls_of(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("name", sorted(ANSWERS))
def test_whole_and_streamed_in_any_cut(name):
    fmt, text = FORMATS[name], ANSWERS[name]
    content, calls = parse_tool_calls(text, fmt)
    assert (content, calls_of(calls)) == (CONTENT[name], [("get_weather", {"city": "Paris"})])
    for cut in range(len(text) + 1):
        stream = ToolCallStream(fmt)
        got, found = stream.feed(text[:cut])
        more, more_found = stream.feed(text[cut:])
        rest, last = stream.finish()
        assert ((got + more + rest).strip() or None) == CONTENT[name], cut
        assert calls_of(found + more_found + last) == [("get_weather", {"city": "Paris"})], cut


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "phi4_mini_json"])
@pytest.mark.parametrize("text", ["Paris is sunny.", "{not json}", "[TOOL_CALLS] nope",
                                  'functools{"x": 1}'])
def test_text_that_is_no_call_stays_content(name, text):
    fmt = FORMATS[name]
    assert parse_tool_calls(text, fmt) == (text, [])
    stream = ToolCallStream(fmt)
    got, found = stream.feed(text)
    rest, last = stream.finish()
    assert (got + rest, found + last) == (text, [])


@pytest.mark.parametrize("template, name", [
    (QWEN_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "llama3_json"),
    ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
    ("<|tool|>{{ tools }}<|/tool|> functools", "phi4_mini_json"), ("{{ messages }}", "hermes"),
    (None, "hermes")])
def test_auto_reads_the_templates_markers(template, name):
    assert resolve_format("auto", template).name == name
    assert resolve_format("mistral", template).name == "mistral"


def test_native_history_keeps_calls_as_objects():
    messages = [{"role": "developer", "content": "Be brief."},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    out = render_messages(messages, None, native=True)
    assert [m["role"] for m in out] == ["system", "assistant", "tool"]
    assert out[1]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                   "arguments": {"city": "Paris"}}
    assert out[2]["tool_call_id"] == "c1"


@pytest.mark.model
@pytest.mark.parametrize("name", ["llama3_json", "mistral", "phi4_mini_json"])
def test_forced_grammar_writes_the_format(name, default_model_path):
    tokenizer = llguidance.LLTokenizer(str(default_model_path / "tokenizer.json"))
    grammar = to_grammar(tool_grammar([WEATHER], "get_weather", False, FORMATS[name]))

    def accepts(text):
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.tokenize_str(text)) and matcher.is_accepting()

    text = ANSWERS[name].replace("Let me check. ", "")
    assert accepts(text)
    assert not accepts(text.replace('"Paris"', "7"))
    assert not accepts(ANSWERS["hermes"].replace("Let me check.\n", ""))


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("template, name", [(QWEN_TEMPLATE, "hermes"),
                                            (LLAMA3_TEMPLATE, "llama3_json")])
async def test_openai_client_gets_tool_calls(template, name, stream):
    engine = FakeEngine()
    engine.tokenizer.chat_template = template
    text = ANSWERS[name]
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    engine.script = lambda req: [accepted(req), *sample_outputs(req, 0, pieces)]
    app = build_app(engine, ServerConfig())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
    client = openai.AsyncOpenAI(base_url="http://t/v1", api_key="k", http_client=http,
                                max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    if not stream:
        reply = await client.chat.completions.create(model="fake-model", messages=messages,
                                                     tools=[WEATHER])
        choice = reply.choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments))
                 for c in choice.message.tool_calls]
        content, finish = choice.message.content, choice.finish_reason
    else:
        chunks = await client.chat.completions.create(model="fake-model", messages=messages,
                                                      tools=[WEATHER], stream=True)
        content, calls, finish = "", [], None
        async for chunk in chunks:
            delta = chunk.choices[0].delta
            content += delta.content or ""
            calls += [(c.function.name, json.loads(c.function.arguments))
                      for c in delta.tool_calls or ()]
            finish = chunk.choices[0].finish_reason or finish
        content = content.strip() or None
    assert calls == [("get_weather", {"city": "Paris"})] and finish == "tool_calls"
    assert content == CONTENT[name]
    [request] = engine.requests
    assert request.chat_template_kwargs == {"tools": [WEATHER]}  # the template renders them
    assert request.messages == tuple(messages)  # no Hermes system prompt of kvserve's
