"""``--chat-template`` (vLLM's flag) and the 400 for a model without a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cli import build_parser, load_chat_template
from kvserve.model.gguf_tokenizer import build_bpe_tokenizer
from kvserve.model.tokenizer import Tokenizer

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "Once upon", "max_tokens": 4}
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"




async def test_chat_without_template_is_400_naming_the_flag(client, engine) -> None:
    engine.tokenizer.chat_template = None
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400
    error = r.json()["error"]
    assert "no chat template" in error["message"]
    assert "--chat-template" in error["message"]
    assert error["param"] == "messages" and error["type"] == "invalid_request_error"
    assert engine.requests == []  # refused before the engine saw it


async def test_completions_work_without_template(client, engine) -> None:
    engine.tokenizer.chat_template = None
    r = await client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200
    assert engine.requests[0].prompt == "Once upon"


async def test_chat_with_template_is_served(client, engine) -> None:
    engine.tokenizer.chat_template = TEMPLATE
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


def _tokenizer_folder(folder: Path, template: str | None) -> Path:
    alphabet = [chr(c) for c in range(ord("!"), ord("~") + 1)] + ["Ġ", "Ċ"]
    tokens = ["<|endoftext|>", "<s>", "</s>", *alphabet]
    build_bpe_tokenizer(tokens, [], [3, 3, 3] + [1] * len(alphabet)).save(
        str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def test_tokenizer_template_override(tmp_path: Path) -> None:
    folder = _tokenizer_folder(tmp_path, "{{ 'checkpoint' }}")
    assert Tokenizer(folder).apply_chat_template([]) == "checkpoint"
    tok = Tokenizer(folder, chat_template=TEMPLATE)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<user>x"


def test_tokenizer_without_template_says_which_flag(tmp_path: Path) -> None:
    tok = Tokenizer(_tokenizer_folder(tmp_path, None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="--chat-template"):
        tok.encode_chat([{"role": "user", "content": "x"}])
    assert Tokenizer(tmp_path, chat_template=TEMPLATE).chat_template == TEMPLATE


def test_load_chat_template_file_text_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE  # the text itself, as vLLM allows
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_flag_parses_for_serve_and_generate() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "--chat-template", "t.jinja"]).chat_template == "t.jinja"
    assert parser.parse_args(["generate", "hi", "--chat-template", "x"]).chat_template == "x"
    assert parser.parse_args(["serve"]).chat_template is None


@pytest.mark.parametrize("template, expected", [
    ("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", "HELLO THERE"),
    ("{% for m in messages %}{{ m['content'][:5] }}{% endfor %}", "hello"),
    ("{% for m in messages %}{{ m['content'].split('</think>')[-1] }}{% endfor %}", "answer"),
    ("{% for m in messages %}{{ m['content'] | length }}{% endfor %}", "11"),
    ("{% for m in messages %}{{ 'T' if m['content'].startswith('hello') else 'F' }}"
     "{% endfor %}", "T"),
])
def test_templates_that_transform_content_see_the_real_text(tmp_path: Path, template: str,
                                                           expected: str) -> None:
    """Issue 47, item 2: a template that transforms a message's content
    (Qwen3's splits off ``</think>``) renders the real text, not a
    placeholder's: the prompt is the template's own rendering, encoded whole."""
    tok = Tokenizer(_tokenizer_folder(tmp_path, template))
    content = "x</think>answer" if "think" in template else "hello there"
    ids = tok.encode_chat([{"role": "user", "content": content}])
    assert tok.decode(ids) == expected


#: Issue 47, item 1: templates that would hold a thread or crash at every render.
LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
HOSTILE_TEMPLATES = {
    "nested loop": (LOOPS, "took more than"),
    "huge range": ("{{ range(10**9) | list }}", "OverflowError"),
    "recursive macro": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
                        "recursed too deep"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_template_is_one_line_and_stops(tmp_path: Path, monkeypatch, name) -> None:
    from kvserve.model import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "TEMPLATE_BUDGET_S", 0.5)
    template, words = HOSTILE_TEMPLATES[name]
    tok = Tokenizer(_tokenizer_folder(tmp_path, template))
    with pytest.raises(ValueError, match=words) as err:
        tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="--chat-template PATH"):
        tok.check_chat_template()


def test_a_refusing_template_is_left_to_its_requests(tmp_path: Path) -> None:
    """``raise_exception`` (a template's own refusal of some chats) is not a
    broken template: start-up goes on, the request that meets it gets a 400."""
    tok = Tokenizer(_tokenizer_folder(
        tmp_path, "{% if messages|length > 1 %}{{ raise_exception('one at a time') }}"
                  "{% endif %}{{ messages[0]['content'] }}"))
    tok.check_chat_template()
    with pytest.raises(ValueError, match="one at a time"):
        tok.encode_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_start_up_refuses_a_looping_template_before_serving(monkeypatch):
    """The server's start-up checks the template off the event loop, before
    the model loads: one line naming the fix, not a wedged ``/health``
    (a tiny checkpoint of tests/model/data/families)."""
    from kvserve import startup
    from kvserve.config import EngineConfig
    from kvserve.model import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "TEMPLATE_BUDGET_S", 0.5)
    folder = Path(__file__).resolve().parents[1] / "model" / "data" / "families" / "llama"
    config = EngineConfig(model=str(folder), chat_template=LOOPS)
    with pytest.raises(ValueError, match="cannot render a one-message chat"):
        startup._load_checkpoint(config)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_continue_final_message_leaves_the_assistant_turn_open(tmp_path: Path) -> None:
    """vLLM's assistant prefill: rendered without a generation prompt, the
    prompt ends where the last (assistant) message's text ends, so the model
    continues it; also when a content holds a special-token string (the
    placeholder path)."""
    tok = Tokenizer(_tokenizer_folder(tmp_path, CHATML.replace("<|im_start|>", "<s>")
                                      .replace("<|im_end|>", "</s>")))
    for prefill in ("The answer is", "x</s>y then"):
        messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": prefill}]
        ids = tok.encode_chat(messages, add_generation_prompt=False, continue_final_message=True)
        text = tok.decode(ids, skip_special_tokens=False)
        assert text.endswith(prefill) and text.count("<s>") == 2, text
        closed = tok.encode_chat(messages, add_generation_prompt=False)
        assert tok.decode(closed, skip_special_tokens=False).endswith("</s>\n")


@pytest.mark.anyio
@pytest.mark.parametrize("fields, words", [
    ({"continue_final_message": True}, "add_generation_prompt"),
    ({"continue_final_message": True, "add_generation_prompt": False,
      "messages": [{"role": "user", "content": "Hi"}]}, "last message must be the assistant"),
])
async def test_prefill_rules_are_400s(client, engine, fields, words) -> None:
    engine.tokenizer.chat_template = TEMPLATE
    r = await client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    error = r.json()["error"]  # found by a new user: param null, pydantic's "Value error, "
    assert error["param"] == "continue_final_message" and error["message"].startswith("contin")


@pytest.mark.anyio
async def test_prefill_reaches_the_engine(client, engine) -> None:
    engine.tokenizer.chat_template = TEMPLATE
    body = {**CHAT, "messages": [{"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello, I"}],
            "continue_final_message": True, "add_generation_prompt": False}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    [request] = engine.requests
    assert (request.continue_final_message, request.add_generation_prompt) == (True, False)


@pytest.mark.anyio
@pytest.mark.parametrize("field, value", [
    ("bad_words", ["no"]), ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 10),
    ("return_token_ids", True), ("grammar", "root ::= \"a\""), ("n_probs", 3),
    ("typical_p", 0.5), ("use_beam_search", True), ("echo", True), ("prompt_logprobs", 2),
])
async def test_unimplemented_vllm_and_llamacpp_fields_are_400s_naming_them(client, engine, field,
                                                                        value) -> None:
    """Issue 48, item 3: a field that would change the answer is honoured or
    refused, never ignored; its no-op value passes."""
    engine.tokenizer.chat_template = TEMPLATE
    r = await client.post("/v1/chat/completions", json={**CHAT, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field and r.json()["error"]["message"].startswith(field)
    assert engine.requests == []
    noop = {"bad_words": [], "allowed_token_ids": None, "truncate_prompt_tokens": None,
            "return_token_ids": False, "grammar": None, "n_probs": 0, "typical_p": 1.0,
            "use_beam_search": False, "echo": False, "prompt_logprobs": None}[field]
    r = await client.post("/v1/chat/completions", json={**CHAT, field: noop})
    assert r.status_code == 200, r.text


@pytest.mark.anyio
async def test_the_400_names_the_template_kvserve_ships_for_the_model(client, engine) -> None:
    """A base Gemma 3 file has no chat template; start-up sets the hint to
    the one kvserve ships, and chat's 400 names it (issue 48, item 8)."""
    engine.tokenizer.chat_template = None
    engine.tokenizer.chat_template_hint = "/repo/docs/chat_templates/gemma3.jinja"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400
    assert "--chat-template /repo/docs/chat_templates/gemma3.jinja" in r.json()["error"]["message"]


def test_start_up_hints_the_shipped_gemma_template(tmp_path: Path) -> None:
    from kvserve import startup

    assert (startup.SHIPPED_TEMPLATES / "gemma3.jinja").is_file()


def test_the_start_up_probe_of_a_slow_template_is_short_and_said(tmp_path: Path,
                                                                monkeypatch) -> None:
    """Found by a new user: a template that loops on two messages cost 15 s
    of start-up (three probes of 5 s). The probe's renders get half a second
    (``PROBE_BUDGET_S``; shortened here), and a line says the template is slow."""
    import structlog

    from kvserve.model import tokenizer as tokenizer_module

    monkeypatch.setattr(tokenizer_module, "PROBE_BUDGET_S", 0.05)
    template = "{% if messages|length > 1 %}" + LOOPS + "{% endif %}{{ messages[0]['content'] }}"
    tok = Tokenizer(_tokenizer_folder(tmp_path, template))
    with structlog.testing.capture_logs() as logs:
        tok.check_chat_template()  # one message renders: start-up goes on
    assert tok.min_tokens_per_message == 1
    assert [e["role"] for e in logs if e["event"] == "chat_template_slow"] == ["system"]
