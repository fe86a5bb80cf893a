"""A scripted ``EngineClient`` for API tests: no model, no actors.

``FakeEngine.script(request)`` returns the events to put on the request's
``RequestStream``; by default an accepted prompt of 3 tokens and, for each of
the ``n`` samples, ``"Hello"`` + ``" world"`` finishing with ``stop``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvserve.actors.messages import (
    GenerateRequest,
    RequestAccepted,
    RequestFailed,
    RequestOutput,
    StreamEvent,
)
from kvserve.actors.stream import RequestStream

Script = Callable[[GenerateRequest], Sequence[StreamEvent]]


class FakeTokenizer:
    """Decodes token id ``i`` as ``"t<i>"``; encodes one token per character
    (its code point); the chat template joins ``role: content`` lines."""

    vocab_size = 0x110000

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"t{i}" for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False,
               parse_special: bool = True) -> list[int]:
        return [ord(ch) for ch in text]

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [f"t{i}" for i in ids]

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def encode_chat(self, messages, add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def accepted(request: GenerateRequest, num_prompt: int = 3) -> RequestAccepted:
    """The usual first event."""
    return RequestAccepted(request.request_id, tuple(range(num_prompt)))


def sample_outputs(request: GenerateRequest, index: int, pieces: Sequence[str],
                   finish: str = "stop", num_prompt: int = 3, cached: int = 0,
                   logprobs: bool = False) -> list[RequestOutput]:
    """One output per piece (one token each); the last carries ``finish``."""
    outputs = []
    for i, piece in enumerate(pieces):
        token_id = 100 * index + i
        lp = ((-0.5, ((token_id, -0.5), (token_id + 1, -1.5))),) if logprobs else None
        outputs.append(RequestOutput(
            request.request_id, index, piece, (token_id,),
            finish_reason=finish if i == len(pieces) - 1 else None,
            num_prompt_tokens=num_prompt, num_cached_tokens=cached,
            num_output_tokens=i + 1, logprobs=lp))
    return outputs


def default_script(request: GenerateRequest) -> list[StreamEvent]:
    """Accepted, then ``Hello world`` for each sample (interleaved)."""
    want_lp = request.sampling_params.logprobs is not None
    per_index = [sample_outputs(request, i, ["Hello", " world"], cached=2, logprobs=want_lp)
                 for i in range(request.sampling_params.n)]
    events: list[StreamEvent] = [accepted(request)]
    for step in zip(*per_index):
        events.extend(step)
    return events


def failing(status: int, message: str, **kw) -> Script:
    """A script that refuses every request with ``RequestFailed``."""
    return lambda request: [RequestFailed(request.request_id, status, message, **kw)]


class FakeEngine:
    """Implements ``EngineClient``; records requests and aborts."""

    model_name = "fake-model"
    max_model_len = 4096

    def __init__(self, script: Script = default_script, ready: bool = True) -> None:
        self.script = script
        self.ready = ready
        self.tokenizer = FakeTokenizer()
        self.requests: list[GenerateRequest] = []
        self.streams: dict[str, RequestStream] = {}
        self.aborted: list[str] = []

    def is_ready(self) -> bool:
        return self.ready

    def generate(self, request: GenerateRequest) -> RequestStream:
        self.requests.append(request)
        stream = RequestStream(request.request_id, request.sampling_params.n)
        self.streams[request.request_id] = stream
        for event in self.script(request):
            stream.put(event)
        return stream

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
