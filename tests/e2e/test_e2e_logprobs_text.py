"""Logprobs must describe the text they came with, also when one character
spans several byte-level tokens (an emoji is 3 tokens of SmolLM2's BPE).

- Chat ``logprobs.content[].bytes`` is, per OpenAI's reference, "the UTF-8
  bytes representation of the token ... useful in instances where characters
  are represented by multiple tokens and their byte representations must be
  combined to generate the correct text representation".
- Completions ``logprobs.text_offset`` is the character offset of each token
  in the completion text: never past the text's end, never decreasing, and
  the same whether the response was streamed or not.
"""

from __future__ import annotations

import pytest
from e2e_support import post_stream

pytestmark = pytest.mark.model

EMOJI_CHAT = {"messages": [{"role": "user", "content": "Repeat exactly: 🎉🎉🎉🎉"}],
              "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 1}
ASCII_CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
              "max_tokens": 8, "temperature": 0, "logprobs": True, "top_logprobs": 1}
EMOJI_COMPLETION = {"prompt": "🎉🎉🎉🎉", "max_tokens": 7, "temperature": 0, "logprobs": 1}
ASCII_COMPLETION = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0,
                    "logprobs": 1}


def _chat_bytes_text(http, body: dict) -> tuple[str, str]:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    content = choice["message"]["content"]
    entries = [e for e in choice["logprobs"]["content"] if e["token"] != "<|im_end|>"]
    joined = b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", errors="replace")
    return content, joined


def test_chat_logprob_bytes_rebuild_ascii_text(http) -> None:
    content, joined = _chat_bytes_text(http, ASCII_CHAT)
    assert joined == content


def test_chat_logprob_bytes_rebuild_multibyte_text(http) -> None:
    content, joined = _chat_bytes_text(http, EMOJI_CHAT)
    assert any(ord(ch) > 0xFFFF for ch in content), f"test precondition: emoji in {content!r}"
    assert joined == content


def _completion_offsets(http, body: dict):
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    full = (choice["text"], choice["logprobs"]["text_offset"])
    streamed = post_stream(http, "/v1/completions", body)
    assert streamed.status == 200 and streamed.done
    text, offsets = "", []
    for chunk in streamed.choice_chunks():
        streamed_choice = chunk["choices"][0]
        text += streamed_choice["text"]
        if streamed_choice["logprobs"]:
            offsets.extend(streamed_choice["logprobs"]["text_offset"])
    return full, (text, offsets)


def _check_offsets(text: str, offsets: list[int], what: str) -> None:
    assert offsets == sorted(offsets), f"{what}: text_offset decreases: {offsets}"
    assert all(0 <= o <= len(text) for o in offsets), \
        f"{what}: text_offset {offsets} past the end of {text!r} ({len(text)} chars)"


def test_completion_text_offset_ascii(http) -> None:
    (full_text, full_offsets), (text, offsets) = _completion_offsets(http, ASCII_COMPLETION)
    assert text == full_text
    _check_offsets(full_text, full_offsets, "non-streamed")
    assert offsets == full_offsets
    assert full_offsets[0] == 0


def test_completion_text_offset_multibyte(http) -> None:
    (full_text, full_offsets), (text, offsets) = _completion_offsets(http, EMOJI_COMPLETION)
    assert text == full_text
    assert any(ord(ch) > 0xFFFF for ch in full_text), f"test precondition: emoji in {full_text!r}"
    _check_offsets(full_text, full_offsets, "non-streamed")
    _check_offsets(text, offsets, "streamed")
    assert offsets == full_offsets


PROMPT_IDS_TEXT = ("The history of the printing press begins in the fifteenth century, when "
                   "Johannes Gutenberg combined movable metal type with an oil-based ink.")


def test_prompt_logprobs_same_with_chunked_prefill(e2e_engine, default_model_path) -> None:
    """Prompt logprobs (``echo``) gathered over several chunked-prefill steps
    equal those of a single-step prefill; the first is None, and each entry
    scores the prompt's own next token."""
    from e2e_support import EngineThread, make_request

    from kvserve.config import CacheConfig, EngineConfig, SchedulerConfig

    request = dict(prompt=PROMPT_IDS_TEXT, max_tokens=2, logprobs=2, prompt_logprobs=3)
    whole = e2e_engine.generate(make_request(**request))
    assert whole.failed is None
    config = EngineConfig(model=str(default_model_path),
                          cache=CacheConfig(kv_cache_memory=16 * 1024**2),
                          scheduler=SchedulerConfig(max_num_batched_tokens=8),
                          logprobs_mode="raw_logits")
    chunked_engine = EngineThread(config)
    try:
        events = chunked_engine.run(_outputs(chunked_engine.engine, make_request(**request)))
    finally:
        chunked_engine.close()
    first_prompt = [e.prompt_logprobs for e in events if e.prompt_logprobs is not None]
    assert len(first_prompt) == 1
    chunked = first_prompt[0]
    prompt_ids = whole.prompt_token_ids
    assert len(prompt_ids) > 16 and len(chunked) == len(prompt_ids) and chunked[0] is None
    assert [t for e in events for t in e.token_ids] == whole.token_ids
    reference = _prompt_logprobs(e2e_engine, request)
    assert reference[0] is None and len(reference) == len(prompt_ids)
    for j, (a, b) in enumerate(zip(chunked[1:], reference[1:]), start=1):
        assert abs(a[0] - b[0]) < 1e-3, (j, a, b)
        assert [t for t, _ in a[1]] == [t for t, _ in b[1]] or abs(a[1][0][1] - a[1][1][1]) < 1e-3
        assert len(a[1]) == 3


async def _outputs(engine, request):
    from kvserve.actors.messages import RequestOutput

    return [e async for e in engine.generate(request) if isinstance(e, RequestOutput)]


def _prompt_logprobs(e2e_engine, request: dict):
    from e2e_support import make_request

    events = e2e_engine.run(_outputs(e2e_engine.engine, make_request(**request)))
    return next(e.prompt_logprobs for e in events if e.prompt_logprobs is not None)


def test_chat_logprobs_leave_out_the_eos_token(http) -> None:
    """Issue 14, item 8: a reply that ends with EOS listed <|im_end|> as its
    last logprob entry, so the entries' bytes no longer joined to the
    content. Measured with greedy decoding: this reply ends with EOS."""
    body = {"messages": [{"role": "user", "content": "Reply with one word: yes or no. "
                          "Is water wet?"}], "max_tokens": 30, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    choice = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    entries = choice["logprobs"]["content"]
    assert all(e["token"] != "<|im_end|>" for e in entries), entries
    assert bytes(b for e in entries for b in e["bytes"]).decode() == choice["message"]["content"]
