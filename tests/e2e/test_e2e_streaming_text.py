"""Acceptance: the streamed text, concatenated, equals the non-streamed text
of the same (greedy) request, including output with multi-byte UTF-8
characters that span several byte-level BPE tokens; no streamed chunk holds
half a character (U+FFFD) unless the full text does too.
"""

from __future__ import annotations

import pytest
from e2e_support import post_stream

pytestmark = pytest.mark.model

REPEAT = 'Repeat exactly: "Café 東京 🎉"\n'

# (endpoint, body): greedy outputs that hold non-ASCII text (checked below).
CASES = {
    "completion_cafe": ("/v1/completions", {"prompt": REPEAT, "max_tokens": 8}),
    "completion_emoji": ("/v1/completions", {"prompt": "Emoji list: 🎉 🎂 🎁", "max_tokens": 12}),
    # max_tokens ends the output inside a 4-byte emoji: the full text then ends
    # with U+FFFD (as Hugging Face's decode gives), and only the last chunk may.
    "completion_emoji_cut": ("/v1/completions", {"prompt": "🎉🎉🎉🎉", "max_tokens": 4}),
    "chat_japanese": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Repeat exactly: 日本語: こんにちは。中文: 你好。日本語: "}],
        "max_tokens": 12}),
}


def _text_of(choice: dict) -> str:
    if "message" in choice:
        return choice["message"]["content"]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice["text"]


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_text_equals_full_text(http, name: str) -> None:
    path, body = CASES[name]
    body = {**body, "temperature": 0}

    full = http.post(path, json=body)
    assert full.status_code == 200, full.text
    full_body = full.json()
    full_text = _text_of(full_body["choices"][0])
    assert any(ord(ch) > 127 for ch in full_text), (
        f"test precondition: the output should hold non-ASCII text, got {full_text!r}")

    streamed = post_stream(http, path, {**body, "stream_options": {"include_usage": True}})
    assert streamed.status == 200, streamed.body
    assert streamed.done
    pieces = []
    finish = []
    for chunk in streamed.choice_chunks():
        for choice in chunk["choices"]:
            piece = _text_of(choice)
            piece.encode("utf-8")  # raises on a lone surrogate
            pieces.append(piece)
            if choice.get("finish_reason") is not None:
                finish.append(choice["finish_reason"])

    assert "".join(pieces) == full_text
    if "\ufffd" not in full_text.rstrip("\ufffd"):
        nonempty = [p for p in pieces if p]
        held_back = nonempty if "\ufffd" not in full_text else nonempty[:-1]
        bad = [p for p in held_back if "\ufffd" in p]
        assert not bad, f"streamed chunks with half a character (U+FFFD): {bad} of {pieces}"
    assert finish == [full_body["choices"][0]["finish_reason"]]
    usage = streamed.usage()
    assert usage is not None
    assert usage["prompt_tokens"] == full_body["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == full_body["usage"]["completion_tokens"]
