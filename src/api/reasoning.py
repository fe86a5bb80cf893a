"""Reasoning parsers: a thinking model's thought out of ``content``, into ``reasoning_content``.

``kvserve serve --reasoning-parser NAME`` (vLLM's flag and names) splits each
chat answer of a model that thinks between ``<think>`` and ``</think>``:

- ``deepseek_r1`` (DeepSeek-R1 and its distills, whose chat template ends
  the prompt with ``<think>\\n``): everything up to ``</think>`` is the
  thought (a ``<think>`` the model writes itself is dropped); the answer
  follows. An answer cut off before ``</think>`` is all thought.
- ``qwen3`` (Qwen3; with ``chat_template_kwargs: {"enable_thinking": false}``
  its template writes an empty thought into the prompt and the model answers
  directly): an answer that starts with ``<think>`` is thought up to
  ``</think>`` (or to its end when cut off), the rest is content; an answer
  that does not start with it is all content.

The thought goes into ``message.reasoning_content`` (streamed as
``delta.reasoning_content``), as vLLM returns it; ``content`` holds what
follows ``</think>``. Tool calls are parsed from the content only. A stream
holds back text that may be the start of a tag (``<thi``) until it knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import REASONING_PARSERS

START, END = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """``(reasoning or None, content)`` of a whole answer ``text`` under ``parser``."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning if stream.thought else None), content


@dataclass
class ReasoningStream:
    """Splits an answer fed in pieces; :meth:`feed` and :meth:`finish`
    return ``(reasoning, content)`` deltas (strings, maybe empty).

    States: ``start`` (before anything is known: a ``<think>`` may come),
    ``thinking`` (until ``</think>``), ``answer`` (the rest is content).
    ``thought``: whether the answer had a thought at all."""

    parser: str
    state: str = "start"
    thought: bool = False
    _held: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {self.parser!r} "
                             f"(known: {', '.join(REASONING_PARSERS)})")

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that ``text`` (appended to what came
        before) makes certain."""
        text = self._held + text
        self._held = ""
        reasoning, content = "", ""
        while text:
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(START):
                    text = stripped[len(START):]
                    self.state, self.thought = "thinking", True
                elif START.startswith(stripped):  # '', '<', '<th': not known yet
                    self._held = text
                    return reasoning, content
                elif self.parser == "deepseek_r1":  # the template opened the thought
                    self.state, self.thought = "thinking", True
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = text.find(END)
                if end >= 0:
                    reasoning += text[:end]
                    text = text[end + len(END):]
                    self.state = "answer"
                    continue
                keep = _partial_suffix(text, END)
                reasoning += text[:len(text) - keep]
                self._held = text[len(text) - keep:]
                return reasoning, content
            else:
                content += text
                text = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, at the end of the answer: a partial tag is
        text of the part it was in."""
        held, self._held = self._held, ""
        if self.state == "thinking":
            return held, ""
        if self.state == "start" and self.parser == "deepseek_r1" and held.strip():
            self.thought = True
            return held, ""
        return "", held


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
