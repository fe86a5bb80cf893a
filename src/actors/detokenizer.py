"""DetokenizerActor: token deltas -> UTF-8-safe text deltas on the client's stream."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.actors.base import Actor
from kvserve.actors.messages import AbortRequest, RequestOutput, TokenDelta, TokenizedRequest
from kvserve.actors.registry import StreamRegistry
from kvserve.core.detokenize import IncrementalDetokenizer


@dataclass
class _Sample:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer
    num_output_tokens: int = 0
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list = field(default_factory=list)


class DetokenizerActor(Actor):
    """Keeps one ``IncrementalDetokenizer`` per sample; finds stop strings.

    When a stop string matches, the sample finishes here with
    ``finish_reason="stop"`` and an ``AbortRequest(reason="stop")`` tells the
    scheduler to free its blocks.
    """

    name = "detokenizer"

    def __init__(self, tokenizer, streams: StreamRegistry) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.streams = streams
        self.scheduler: Actor | None = None
        self._samples: dict[str, _Sample] = {}

    async def handle(self, message: TokenizedRequest | TokenDelta) -> None:
        if isinstance(message, TokenizedRequest):
            self._register(message)
        else:
            self._on_delta(message)

    def _register(self, request: TokenizedRequest) -> None:
        params = request.sampling_params
        skip = params.skip_special_tokens

        def decode(ids):
            return self.tokenizer.decode(ids, skip_special_tokens=skip)

        detok = IncrementalDetokenizer(decode, params.stop, params.include_stop_str_in_output)
        self._samples[request.request_id] = _Sample(request.parent_id, request.index, detok)

    def _on_delta(self, delta: TokenDelta) -> None:
        sample = self._samples.get(delta.request_id)
        if sample is None:
            return  # already finished by a stop string
        sample.num_output_tokens += len(delta.new_token_ids)
        sample.pending_ids.extend(delta.new_token_ids)
        sample.pending_logprobs.extend(delta.logprobs or ())
        text = sample.detokenizer.update(delta.new_token_ids, finished=delta.finish_reason is not None)
        finish_reason = delta.finish_reason
        if text.stopped and finish_reason is None:
            finish_reason = "stop"
            if self.scheduler is not None:
                self.scheduler.send(AbortRequest((delta.request_id,), reason="stop"))
        if finish_reason is not None:
            del self._samples[delta.request_id]
        if text.text or finish_reason is not None:
            self._emit(sample, delta, text.text, finish_reason)

    def _emit(self, sample: _Sample, delta: TokenDelta, text: str, finish_reason: str | None) -> None:
        """Send the text with the tokens held back since the last output."""
        self.streams.put(sample.parent_id, RequestOutput(
            request_id=sample.parent_id, index=sample.index, text=text,
            token_ids=tuple(sample.pending_ids), finish_reason=finish_reason,
            num_prompt_tokens=delta.num_prompt_tokens,
            num_cached_tokens=delta.num_cached_tokens,
            num_output_tokens=sample.num_output_tokens,
            logprobs=tuple(sample.pending_logprobs) or None, error=delta.error))
        sample.pending_ids.clear()
        sample.pending_logprobs.clear()
