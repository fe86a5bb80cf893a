"""Incremental, UTF-8-safe detokenization with stop strings.

Byte-level BPE tokens can end in the middle of a multi-byte UTF-8 character;
decoding such a prefix yields U+FFFD. Following the "prefix offset / read
offset" method of Hugging Face TGI and vLLM, new text is released only when
decoding the window no longer ends in U+FFFD. Stop strings are searched in
the released text; up to ``len(longest stop) - 1`` characters are held back
so a stop string that spans token boundaries is never streamed even in part.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Decode = Callable[[Sequence[int]], str]
REPLACEMENT_CHAR = "\ufffd"


@dataclass(frozen=True)
class DetokenizedDelta:
    """Text released by one update: ``text`` to send, and whether a stop
    string matched (``stopped``; then ``stop_str`` is the match and
    ``stop_end`` the character offset just past it in the output text, so
    that tokens starting there or later are not part of the output)."""

    text: str
    stopped: bool = False
    stop_str: str | None = None
    stop_end: int | None = None


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        decode: ``token_ids -> str`` (special tokens already skipped or not,
            as the request asked).
        stop: stop strings (OpenAI ``stop``); the output ends before the
            first one found, or after it when ``include_stop_str_in_output``.
    """

    def __init__(self, decode: Decode, stop: Sequence[str] = (),
                 include_stop_str_in_output: bool = False) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""          # all decoded text so far (after any stop cut)
        self._emitted = 0       # characters of ``text`` already released

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> DetokenizedDelta:
        """Add tokens; return the text that is safe to release now.

        On ``finished`` the rest is flushed (including a trailing U+FFFD if the
        tokens really end mid-character, as the non-streamed text would).
        """
        start = len(self.text)
        self.token_ids.extend(new_token_ids)
        self.text += self._decode_new(flush=finished)
        match = self._find_stop(start)
        if match is not None:
            index, stop_str = match
            stop_end = index + len(stop_str)
            self.text = self.text[:stop_end if self._include_stop else index]
            return DetokenizedDelta(self._release(len(self.text)), True, stop_str, stop_end)
        end = len(self.text) if finished else max(self._emitted, len(self.text) - self._holdback)
        return DetokenizedDelta(self._release(end))

    def _decode_new(self, flush: bool) -> str:
        ids = self.token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not flush):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return full_text[len(prefix_text):]

    def _find_stop(self, start: int) -> tuple[int, str] | None:
        """Earliest stop string that ends in the new text; (its index, stop)."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.text.find(stop, max(0, start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _release(self, end: int) -> str:
        text = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return text
