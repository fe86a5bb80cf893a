"""DetokenizerActor: token deltas -> UTF-8-safe text deltas on the client's stream."""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import (AbortRequest, CloseStream, Deliver, OpenStream,
                                     RequestFailed, RequestOutput, TokenDelta, TokenizedRequest)
from kvserve.actors.registry import StreamRegistry, child_request_ids
from kvserve.actors.stream import RequestStream
from kvserve.core.incremental_text import IncrementalDetokenizer


class TokenOffsets:
    """Character offset of each token in the text its tokens decode to.

    A token's offset is the number of characters completed by the tokens
    before it: the UTF-8 bytes of the tokens (``token_bytes``) go through an
    incremental decoder, so a token holding the second half of a character
    starts at that character, and offsets never decrease. Tokens that the
    text leaves out (``skipped``: special tokens under
    ``skip_special_tokens``) add no characters.
    """

    def __init__(self, token_bytes: Callable[[int], bytes], skipped: frozenset[int]) -> None:
        self._token_bytes = token_bytes
        self._skipped = skipped
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.num_chars = 0

    def add(self, token_id: int) -> int:
        """The offset of ``token_id`` (appended after the tokens seen so far)."""
        offset = self.num_chars
        if token_id not in self._skipped:
            self.num_chars += len(self._decoder.decode(self._token_bytes(token_id)))
        return offset


def token_bytes_of(tokenizer) -> Callable[[int], bytes]:
    """``tokenizer.id_to_bytes`` when it has it, else the token's decoded text."""
    id_to_bytes = getattr(tokenizer, "id_to_bytes", None)
    if callable(id_to_bytes):
        def token_bytes(token_id: int) -> bytes:
            try:
                return id_to_bytes(token_id)
            except ValueError:
                return b""
        return token_bytes
    return lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False).encode()


@dataclass
class _Sample:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    offsets: TokenOffsets
    hidden: frozenset[int]  # ids the text leaves out (skipped special tokens)
    num_output_tokens: int = 0
    num_emitted_chars: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)
    pending_offsets: list[int] = field(default_factory=list)
    prompt_logprobs: tuple[Any, ...] | None = None


class DetokenizerActor(Actor):
    """Writes the clients' streams, and only it does; keeps one
    ``IncrementalDetokenizer`` per sample and finds stop strings.

    Inbox: ``OpenStream`` (the engine opened a request's stream), ``Deliver``
    (an acceptance, refusal, timeout or shutdown for an open stream),
    ``CloseStream`` (the client left), ``TokenizedRequest`` (a sample to
    detokenize) and ``TokenDelta`` (a sample's new tokens).

    When a stop string matches, the sample finishes here with
    ``finish_reason="stop"`` and an ``AbortRequest(reason="stop")`` tells
    admission (then the scheduler) to free its blocks.

    Tokens (with their logprobs and text offsets) go out with the output
    whose text holds their first character, so a streamed chunk's tokens
    describe that chunk's text; tokens whose text is still held back (a
    partial UTF-8 character, a possible stop string) wait, and the last
    output carries all that remain.

    Args:
        tokenizer: decodes token ids.
        admission: the admission actor's mailbox (aborts of stopped samples
            and of a failed sample's siblings).
        on_closed: called with a request id and its stream when the stream
            closes (ended, failed or closed by the engine), so the engine
            frees the id.
    """

    name = "detokenizer"
    accepts = (OpenStream, Deliver, CloseStream, TokenizedRequest, TokenDelta)

    def __init__(self, tokenizer, admission: Mailbox,
                 on_closed: Callable[[str, RequestStream], None] | None = None,
                 inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.tokenizer = tokenizer
        self.admission = admission
        self.streams = StreamRegistry()
        self.streams.on_close = on_closed
        self._samples: dict[str, _Sample] = {}
        self._token_bytes = token_bytes_of(tokenizer)
        self._special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    async def handle(self, message) -> None:
        if isinstance(message, TokenDelta):
            self._on_delta(message)
        elif isinstance(message, TokenizedRequest):
            self._register(message)
        elif isinstance(message, Deliver):
            self.streams.put(message.request_id, message.event)
        elif isinstance(message, OpenStream):
            self.streams.adopt(message.request_id, message.stream)
        elif isinstance(message, CloseStream):
            self.streams.close(message.request_id)

    def _register(self, request: TokenizedRequest) -> None:
        params = request.sampling_params
        skip = params.skip_special_tokens

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip)

        hidden = self._special_ids if skip else frozenset()
        detok = IncrementalDetokenizer(decode, params.stop, params.include_stop_str_in_output)
        self._samples[request.request_id] = _Sample(request.parent_id, request.index, detok,
                                                    TokenOffsets(self._token_bytes, hidden), hidden)

    def _on_delta(self, delta: TokenDelta) -> None:
        """Fold one step's tokens of a sample in; O(new tokens) per call.

        Hidden (skipped special) tokens never reach the ``IncrementalDetokenizer``:
        they decode to nothing, and a run of them would otherwise keep its
        decode window from advancing (O(run length) per step).
        """
        sample = self._samples.get(delta.request_id)
        if sample is None:
            return  # already finished by a stop string
        if delta.finish_reason == "error":
            self._fail(sample, delta)
            return
        if delta.prompt_logprobs is not None:
            sample.prompt_logprobs = delta.prompt_logprobs
        sample.num_output_tokens += len(delta.new_token_ids)
        sample.pending_ids.extend(delta.new_token_ids)
        sample.pending_offsets.extend(sample.offsets.add(t) for t in delta.new_token_ids)
        sample.pending_logprobs.extend(delta.logprobs or ())
        visible = [t for t in delta.new_token_ids if t not in sample.hidden]
        text = sample.detokenizer.update(visible, finished=delta.finish_reason is not None)
        finish_reason = delta.finish_reason
        if text.stopped and finish_reason in (None, "length"):
            # A stop string in the last allowed token wins over the length
            # limit, as in vLLM and the OpenAI API.
            _drop_tokens_after(sample, text.stop_end, len(delta.new_token_ids))
            if finish_reason is None:
                self.admission.send(AbortRequest((delta.request_id,), reason="stop",
                                                 num_output_tokens=(sample.num_output_tokens,)))
            finish_reason = "stop"
        if finish_reason is not None:
            del self._samples[delta.request_id]
        if text.text or finish_reason is not None:
            self._emit(sample, delta, text.text, finish_reason)

    def _fail(self, sample: _Sample, delta: TokenDelta) -> None:
        """The engine failed this sample (a step raised): the client's request
        ends with a 500 error event, and its other samples are aborted."""
        n = self.streams.num_samples(sample.parent_id)
        del self._samples[delta.request_id]
        self.streams.fail(RequestFailed(
            sample.parent_id, 500, f"The engine failed while computing this request: "
            f"{delta.error or 'unknown error'}", type="server_error"))
        siblings = tuple(rid for rid in child_request_ids(sample.parent_id, n)
                         if rid != delta.request_id)
        if siblings:
            self.admission.send(AbortRequest(siblings, reason="abort"))

    def _emit(self, sample: _Sample, delta: TokenDelta, text: str, finish_reason: str | None) -> None:
        """Send the text with the tokens whose first character it holds."""
        sample.num_emitted_chars += len(text)
        end = sample.num_emitted_chars
        if finish_reason is not None:
            count = len(sample.pending_ids)
        else:
            count = sum(1 for offset in sample.pending_offsets if offset < end)
        ids, sample.pending_ids = sample.pending_ids[:count], sample.pending_ids[count:]
        offsets, sample.pending_offsets = (sample.pending_offsets[:count],
                                           sample.pending_offsets[count:])
        logprobs, sample.pending_logprobs = (sample.pending_logprobs[:count],
                                             sample.pending_logprobs[count:])
        prompt_logprobs, sample.prompt_logprobs = sample.prompt_logprobs, None
        self.streams.put(sample.parent_id, RequestOutput(
            request_id=sample.parent_id, index=sample.index, text=text,
            token_ids=tuple(ids), finish_reason=finish_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            num_output_tokens=sample.num_output_tokens,
            logprobs=tuple(logprobs) or None, error=delta.error,
            text_offsets=tuple(min(offset, end) for offset in offsets),
            prompt_logprobs=prompt_logprobs))


def _drop_tokens_after(sample: _Sample, stop_end: int | None, num_new: int) -> None:
    """Forget the tokens of the latest delta (``num_new`` of them) that start
    at or after ``stop_end`` (characters): a speculative step can accept
    several tokens past the one that completed a stop string, and those are
    no more part of the output than the tokens a later step would sample."""
    if stop_end is None:
        return
    extra = sum(1 for offset in sample.pending_offsets[-num_new:] if offset >= stop_end)
    if not extra:
        return
    kept = len(sample.pending_ids) - extra
    if len(sample.pending_logprobs) > kept:
        del sample.pending_logprobs[kept:]
    del sample.pending_ids[kept:], sample.pending_offsets[kept:]
    sample.num_output_tokens -= extra
