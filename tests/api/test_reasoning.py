"""``--reasoning-parser`` (``kvserve.api.reasoning``) and ``chat_template_kwargs``.

The parsers against answers written by hand as DeepSeek-R1 and Qwen3 give
them (vLLM's behaviour: the thought in ``reasoning_content``, the answer in
``content``), streamed in every split against whole; through the API with a
fake engine, streamed and not; and Qwen3's own chat template (the published
one's thinking switch, abridged) rendering the no-think prompt for
``{"enable_thinking": false}``.
"""

from __future__ import annotations

import json

import pytest
from fake_engine import accepted, sample_outputs

from kvserve.api.reasoning import ReasoningStream, split_reasoning
from kvserve.config import ServerConfig

CASES = [
    # parser, answer, (reasoning, content)
    ("qwen3", "<think>\nAdd 2 and 2.\n</think>\n\nIt is 4.", ("\nAdd 2 and 2.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),
    ("qwen3", "<think>\n\n</think>\n\nIt is 4.", ("\n\n", "\n\nIt is 4.")),
    ("qwen3", "<think>cut off by max_tok", ("cut off by max_tok", "")),
    ("qwen3", "x < y and <thinking> is no tag", (None, "x < y and <thinking> is no tag")),
    ("deepseek_r1", "Add 2 and 2.\n</think>\n\nIt is 4.", ("Add 2 and 2.\n", "\n\nIt is 4.")),
    ("deepseek_r1", "<think>Add.</think>4", ("Add.", "4")),
    ("deepseek_r1", "still thinking", ("still thinking", "")),
]


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_split(parser, text, expected):
    assert split_reasoning(text, parser) == expected


@pytest.mark.parametrize("parser, text, expected", CASES)
def test_streamed_in_any_two_pieces_equals_whole(parser, text, expected):
    want_reasoning, want_content = expected
    for cut in range(len(text) + 1):
        for cut2 in range(cut, len(text) + 1, 3):
            stream = ReasoningStream(parser)
            reasoning = content = ""
            for piece in (text[:cut], text[cut:cut2], text[cut2:]):
                r, c = stream.feed(piece)
                reasoning, content = reasoning + r, content + c
            r, c = stream.finish()
            reasoning, content = reasoning + r, content + c
            assert (reasoning if stream.thought else None, content) == expected, (cut, cut2)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown reasoning parser 'r2'"):
        ReasoningStream("r2")


PIECES = ["<think>", "\nAdd", " 2.\n", "</th", "ink>", "\n\nIt", " is 4."]
CHAT = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 16}


@pytest.fixture
def server_config() -> ServerConfig:
    return ServerConfig(max_request_bytes=4096, reasoning_parser="qwen3")


@pytest.fixture
def engine(engine):
    engine.script = lambda request: [accepted(request), *sample_outputs(request, 0, PIECES)]
    return engine


@pytest.mark.anyio
async def test_api_message_has_reasoning_content(client):
    r = await client.post("/v1/chat/completions", json=CHAT)
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "\nAdd 2.\n"
    assert message["content"] == "\n\nIt is 4."


@pytest.mark.anyio
async def test_api_stream_has_reasoning_deltas(client):
    reasoning = content = ""
    async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "") or ""
    assert (reasoning, content) == ("\nAdd 2.\n", "\n\nIt is 4.")


@pytest.mark.anyio
async def test_chat_template_kwargs_reach_the_engine(client, engine):
    r = await client.post("/v1/chat/completions",
                          json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200
    assert engine.requests[0].chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["messages", "add_generation_prompt", "tools", "not a name"])
async def test_reserved_template_names_are_400(client, engine, name):
    r = await client.post("/v1/chat/completions",
                          json={**CHAT, "chat_template_kwargs": {name: 1}})
    assert r.status_code == 400 and "chat_template_kwargs" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert engine.requests == []


#: Qwen3's published chat template, its generation prompt's thinking switch.
QWEN3_TAIL = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_enable_thinking_false_renders_the_no_think_prompt(tmp_path):
    """The tokenizer actor passes ``chat_template_kwargs`` to the template:
    Qwen3's then writes the empty thought into the prompt."""
    from test_chat_template import _tokenizer_folder

    from kvserve.model.tokenizer import Tokenizer
    tokenizer = Tokenizer(_tokenizer_folder(tmp_path, QWEN3_TAIL))
    messages = [{"role": "user", "content": "Hi"}]
    think = tokenizer.apply_chat_template(messages)
    no_think = tokenizer.apply_chat_template(messages, enable_thinking=False)
    assert think.endswith("<|im_start|>assistant\n")
    assert no_think == think + "<think>\n\n</think>\n\n"
    assert tokenizer.encode_chat(messages, enable_thinking=False) == \
        tokenizer.encode(no_think, add_special_tokens=False)


def test_llama3_templates_date_helper(tmp_path):
    """Llama 3.1+ templates call ``strftime_now`` (a transformers helper) when
    no ``date_string`` is given."""
    import datetime

    from test_chat_template import _tokenizer_folder

    from kvserve.model.tokenizer import Tokenizer
    template = ("{% if not date_string is defined %}{% set date_string = strftime_now('%Y') %}"
                "{% endif %}Today: {{ date_string }}")
    tokenizer = Tokenizer(_tokenizer_folder(tmp_path, template))
    assert tokenizer.apply_chat_template([]) in (
        f"Today: {datetime.datetime.now().year}", f"Today: {datetime.datetime.now().year - 1}")
