"""A slow chat template never holds the event loop (issue 47, item 1, found
again by a new user: one looping render kept ``/health`` waiting 4.6 s). A
short chat renders on the loop for at most ``INLINE_RENDER_BUDGET_S``, then
again on the tokenizer's pool with the template's own budget. A tiny
checkpoint's tokenizer (``tests/model/data/families/llama``), no model."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from test_actors_offload import RecordingTokenizer, request, run_batch

from kvserve.actors import tokenizer as actor_module
from kvserve.model.tokenizer import Tokenizer

FOLDER = Path(__file__).resolve().parents[1] / "model" / "data" / "families" / "llama"
SLOW = ("{% for i in range(300) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}")


def test_a_slow_chat_template_renders_on_the_pool_not_the_loop(monkeypatch):
    monkeypatch.setattr(actor_module, "INLINE_RENDER_BUDGET_S", 0.01)
    tok = RecordingTokenizer(Tokenizer(FOLDER, SLOW))
    received, failures = asyncio.run(run_batch(tok, [
        request("slow", messages=({"role": "user", "content": "hi"},))]))
    assert not failures and len(received) == 1
    renders = [thread for kind, thread, _ in tok.calls if kind == "template"]
    assert renders[0] == threading.get_ident()  # tried on the loop, stopped at the budget
    assert len(renders) == 2 and renders[1] != threading.get_ident()  # then on the pool


def test_a_quick_template_stays_on_the_loop():
    tok = RecordingTokenizer(Tokenizer(FOLDER, "{% for m in messages %}{{ m['content'] }}"
                                               "{% endfor %}"))
    received, failures = asyncio.run(run_batch(tok, [
        request("quick", messages=({"role": "user", "content": "hi"},))]))
    assert not failures and len(received) == 1
    assert [t for kind, t, _ in tok.calls if kind == "template"] == [threading.get_ident()]
