"""Request handling shared by the chat and completions routes.

One request goes: read the body (size limit, JSON) -> validate (pydantic) ->
``SamplingParams`` (the server's generation defaults in the fields the body
omits) -> ``engine.generate`` -> wait for the first event
(``RequestAccepted`` or ``RequestFailed``) -> answer in JSON or stream SSE.
Whenever the request ends before its stream finished (client gone, error),
``engine.abort`` is called.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import structlog
from pydantic import ValidationError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvserve.actors.messages import (
    GenerateRequest,
    RequestAccepted,
    RequestFailed,
    RequestOutput,
    StreamEvent,
)
from kvserve.actors.detokenizer import token_bytes_of
from kvserve.actors.stream import EngineClient, RequestStream
from kvserve.actors.tokenizer import PromptError, check_message_count
from kvserve.api.errors import APIError, error_body, from_failed
from kvserve.api.tool_calls import ToolFormat, resolve_format, template_knows_tools
from kvserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenBytes,
    TokenText,
    validation_error_param,
    value_error_param,
)
from kvserve.api.rendering import ChoiceState, Renderer
from kvserve.config import ServerConfig
from kvserve.core.sampling_params import SamplingParams
from kvserve.model.generation_config import GenerationDefaults

log = structlog.get_logger("kvserve.api")

T = TypeVar("T")
ModelT = TypeVar("ModelT", ChatCompletionRequest, CompletionRequest)

#: Status answered (to nobody) when the client left before the response.
CLIENT_CLOSED = 499
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
#: ``X-Request-Class``: a short label copied into every log line and metric
#: of the request, so bounded like ``X-Request-Id``.
_REQUEST_CLASS_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")
#: ``X-Priority``: optional minus sign and decimal digits, nothing else
#: (Python's ``int`` would also take "+5", " 5 " and "1_000").
_PRIORITY_RE = re.compile(r"^-?[0-9]{1,18}$")
#: A chunk or response that lists logprobs for more tokens than this (echoed
#: prompt plus output) is rendered and JSON-encoded on a worker thread, off
#: the event loop: it costs ~5 us a token (token texts, dicts, JSON), so a
#: 9,000-token ``echo`` with logprobs would block the loop for ~60 ms.
OFFLOAD_MIN_LOGPROB_TOKENS = 256
#: Lists longer than this are JSON-encoded in slices (see ``json_in_pieces``).
JSON_PIECE_ITEMS = 256


# --------------------------------------------------------------------------- input


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """Read and decode a JSON object body.

    Raises ``APIError``: 415 for a non-JSON content type, 413 over
    ``max_bytes`` (checked on ``Content-Length`` and while reading), 400 for
    malformed JSON or a body that is not a JSON object, 499 (logged once at
    info level) when the client disconnects before the body is complete.
    """
    _check_content_type(request)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise _too_large(max_bytes) if length.isdigit() else APIError(400, "Invalid Content-Length")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
    except ClientDisconnect:  # the client's choice, not a server error: one info line
        log.info("client_disconnected", phase="request_body", bytes_received=len(body),
                 request_id=request.headers.get("x-request-id"), path=request.url.path)
        raise APIError(CLIENT_CLOSED, "The client disconnected while sending the request body",
                       code="client_disconnected") from None
    try:
        data = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise APIError(400, f"We could not parse the JSON body of your request: {exc}",
                       code="invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object", code="invalid_json")
    _reject_lone_surrogates(data)
    return data


def _reject_lone_surrogates(value: Any, path: str = "") -> None:
    """400 for a string holding a lone UTF-16 surrogate (``"\\ud800"``): valid
    JSON escapes, but not Unicode text, so no tokenizer can take it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"{path or 'A string'} contains a lone UTF-16 surrogate, "
                           "which is not valid Unicode text", param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_lone_surrogates(item, f"{path}.{index}")


def _reject_constant(name: str) -> Any:
    """``NaN``/``Infinity`` are not JSON (RFC 8259); Python's parser would accept them."""
    raise ValueError(f"{name} is not a valid JSON value")


def _check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type")
    if content_type is None:
        return  # lenient: curl -d without -H still works if the body is JSON
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"Unsupported Content-Type {media!r}; send application/json",
                       code="unsupported_media_type")


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"Request body is larger than the limit of {max_bytes} bytes",
                    code="request_too_large")


def refuse_message_flood(data: dict[str, Any], engine: EngineClient) -> None:
    """400 naming ``messages`` when a body holds more chat messages than the
    context can hold (``check_message_count``), found from the list's
    length before the body is validated or rendered: a 1 MiB body carries
    ~33,000 messages, which cost seconds of validation and rendering."""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return
    per = getattr(getattr(engine, "tokenizer", None), "min_tokens_per_message", 1)
    try:
        check_message_count(len(messages), per if isinstance(per, int) else 1,
                            engine.max_model_len)
    except PromptError as exc:
        raise APIError(400, str(exc), param="messages") from exc


def parse_model(model_cls: type[ModelT], data: dict[str, Any]) -> ModelT:
    """Validate ``data``; a ``ValidationError`` becomes a 400 naming the field.
    Fields the model does not know are ignored (OpenAI's clients send new
    ones first) and logged as ``request_fields_ignored`` (vLLM warns the
    same), so that a misspelt ``max_token`` does not go unnoticed."""
    try:
        parsed = model_cls.model_validate(data)
    except ValidationError as exc:
        param, message = validation_error_param(exc)
        raise APIError(400, message, param=param) from exc
    refused = unsupported_field(model_cls, data)
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0])
    ignored = ignored_fields(model_cls, data)
    if ignored:
        log.warning("request_fields_ignored", fields=ignored,
                    message=f"The following fields were present in the request but ignored: "
                            f"{', '.join(ignored)}")
    return parsed


#: vLLM's and llama.cpp's request fields that change the output and that
#: kvserve does not implement: ``field -> (what is a no-op, why / what to
#: use)``. Sent with another value, they are a 400 naming the field, never a
#: silent 200 (issue 48, item 3); ``None`` as the no-op means any value but
#: null (and an empty list) is refused.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, str]] = {
    "bad_words": (None, "vLLM's bad_words is not implemented; logit_bias bans single tokens"),
    "allowed_token_ids": (None, "vLLM's allowed_token_ids is not implemented; use "
                                "structured_outputs (choice, regex) or logit_bias"),
    "truncate_prompt_tokens": (None, "vLLM's truncate_prompt_tokens is not implemented: "
                                     "send the prompt you want read"),
    "return_token_ids": (False, "vLLM's return_token_ids is not implemented; "
                                "/tokenize gives a prompt's ids"),
    "return_tokens_as_token_ids": (False, "vLLM's return_tokens_as_token_ids is not "
                                          "implemented"),
    "grammar": (None, "llama.cpp's GBNF grammar is not read; send a Lark grammar as "
                      "structured_outputs: {\"grammar\": ...}"),
    "n_probs": (0, "llama.cpp's n_probs is not read; use logprobs / top_logprobs"),
    "mirostat": (0, "Mirostat sampling is not implemented"),
    "typical_p": (1.0, "typical sampling is not implemented"),
    "tfs_z": (1.0, "tail-free sampling is not implemented"),
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "length_penalty acts on beam search, which is not implemented"),
    "spaces_between_special_tokens": (True, "spaces_between_special_tokens: false is not "
                                            "implemented"),
    "logits_processors": (None, "custom logits processors are not loaded"),
}
#: Fields of chat requests only (completions implement them).
UNSUPPORTED_CHAT_FIELDS: dict[str, tuple[Any, str]] = {
    "echo": (False, "echo is a completions field here; chat does not repeat the prompt"),
    "prompt_logprobs": (None, "prompt_logprobs is a completions field here (with echo and "
                              "logprobs)"),
}


def unsupported_field(model_cls: type[Any], data: dict[str, Any]) -> tuple[str, str] | None:
    """``(field, message)`` of the first field of ``data`` in
    ``UNSUPPORTED_FIELDS`` (or ``UNSUPPORTED_CHAT_FIELDS`` for a chat body)
    that ``model_cls`` does not read and whose value is not the no-op one;
    None when there is none."""
    table = dict(UNSUPPORTED_FIELDS)
    if model_cls is ChatCompletionRequest:
        table.update(UNSUPPORTED_CHAT_FIELDS)
    known = set(getattr(model_cls, "model_fields", {}))
    for name in sorted(k for k in data if k in table and k not in known):
        value, (noop, why) = data[name], table[name]
        if value is None or value == noop or value == [] or value == {}:
            continue
        return name, f"{name}: {why}"
    return None


#: Most ignored field names one ``request_fields_ignored`` line lists.
MAX_IGNORED_FIELDS = 20


def ignored_fields(model_cls: type[Any], data: dict[str, Any]) -> list[str]:
    """The top-level keys of ``data`` that ``model_cls`` (a pydantic model)
    has no field or alias for, sorted, at most ``MAX_IGNORED_FIELDS``, each
    cut to 64 characters."""
    known = set()
    for name, info in model_cls.model_fields.items():
        known.update(a for a in (name, info.alias, info.validation_alias) if isinstance(a, str))
    return sorted(str(k)[:64] for k in data if k not in known)[:MAX_IGNORED_FIELDS]


@dataclass(frozen=True)
class RequestHeaders:
    """What kvserve reads from the headers: id, priority and class."""

    request_id: str | None
    priority: int | None
    request_class: str | None

    @classmethod
    def parse(cls, request: Request) -> RequestHeaders:
        """Read ``X-Request-Id``, ``X-Priority`` (an int) and ``X-Request-Class``.

        Raises ``APIError`` 400 naming the header when one is malformed.
        """
        headers = request.headers
        request_id = headers.get("x-request-id")
        if request_id is not None and not _REQUEST_ID_RE.match(request_id):
            raise APIError(400, "X-Request-Id must be 1-128 characters of "
                           "[A-Za-z0-9._:-]", param="X-Request-Id")
        priority = headers.get("x-priority")
        if priority is not None:
            if not _PRIORITY_RE.match(priority):
                raise APIError(400, f"X-Priority must be a decimal integer (an optional '-' "
                               f"and up to 18 digits), got {priority[:40]!r}",
                               param="X-Priority")
            priority = int(priority)
        request_class = headers.get("x-request-class")
        if request_class is not None and not _REQUEST_CLASS_RE.match(request_class):
            raise APIError(400, "X-Request-Class must be 1-64 characters of [A-Za-z0-9._:-]",
                           param="X-Request-Class")
        return cls(request_id, priority, request_class)


def sampling_params_or_400(body: ChatCompletionRequest | CompletionRequest,
                           defaults: GenerationDefaults | None = None,
                           tool_format: ToolFormat | None = None) -> SamplingParams:
    """``body.sampling_params(defaults)``, its ``ValueError`` as a 400 naming
    the field. ``defaults``: the server's generation defaults, applied to
    the fields the body omits (``ServerConfig.generation_defaults``;
    ``kvserve.api.protocol.with_defaults``). A structured-output constraint
    is compiled later, by the engine (``kvserve.constraints.compiler``:
    bounded, never on the event loop), which refuses one that does not
    compile with a 400 naming its field."""
    try:
        params = (body.sampling_params(defaults, tool_format)
                  if isinstance(body, ChatCompletionRequest) else body.sampling_params(defaults))
    except ValueError as exc:
        message = str(exc)
        param = value_error_param(message, tuple(type(body).model_fields))
        if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
            param = "max_completion_tokens"
        if param == "logprobs" and getattr(body, "top_logprobs", None) is not None:
            param = "top_logprobs"
        raise APIError(400, message, param=param) from exc
    return params


def token_bytes_for(engine: EngineClient) -> TokenBytes | None:
    """A token's raw UTF-8 bytes (``engine.tokenizer.id_to_bytes``), or None
    when the engine's tokenizer cannot tell (then the token text's bytes are used)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None or not callable(getattr(tokenizer, "id_to_bytes", None)):
        return None
    return token_bytes_of(tokenizer)


def token_text_for(engine: EngineClient) -> TokenText:
    """How to show a token id as text in logprobs.

    Uses ``engine.token_text(id)`` when the engine has it, else
    ``engine.tokenizer.decode([id], skip_special_tokens=False)``, else
    ``"token_id:<id>"`` (vLLM's spelling for untokenizable ids).
    """
    token_text = getattr(engine, "token_text", None)
    if callable(token_text):
        return token_text
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None:
        return functools.partial(_decoded_token_text, tokenizer)
    return lambda token_id: f"token_id:{token_id}"


@functools.lru_cache(maxsize=1 << 17)
def _decoded_token_text(tokenizer, token_id: int) -> str:
    """``tokenizer.decode([token_id])`` with special tokens kept, cached:
    logprobs name the same tokens again and again (~0.1 us a hit, ~2 us a decode)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


# --------------------------------------------------------------------------- disconnects


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports ``http.disconnect``."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run ``work()`` while watching for the client leaving.

    Returns ``(True, None)`` when the client disconnected first (``work`` is
    cancelled), else ``(False, result)``; exceptions of ``work`` propagate
    unwrapped. Call only after the body was read.
    """
    outcome: list[tuple[bool, Any]] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            await wait_for_disconnect(receive)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            outcome.append((True, await work()))
        except Exception as exc:  # re-raised below, outside the task group
            outcome.append((False, exc))
        group.cancel_scope.cancel()
    if not outcome:
        return True, None
    ok, value = outcome[0]
    if not ok:
        raise value
    return False, value


class EventStreamResponse(Response):
    """A ``text/event-stream`` response that always watches for disconnects.

    Unlike Starlette's ``StreamingResponse`` it listens for
    ``http.disconnect`` whatever the server's ASGI spec version, and it
    always awaits ``on_close`` (shielded from cancellation) when the stream
    ends, however it ends.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]],
                 headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                           **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as group:

            async def watch() -> None:
                await wait_for_disconnect(receive)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            try:
                await self._send_all(send)
            except OSError:
                pass  # the client went away while we were sending
            finally:
                group.cancel_scope.cancel()
                with anyio.CancelScope(shield=True):
                    await _aclose(self.events)
                    await self.on_close()

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _aclose(iterator: AsyncIterator[bytes]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


def sse(data: dict[str, Any] | str, large: bool = False) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (a ``large`` one encoded
    with ``json_in_pieces``: same text)."""
    if isinstance(data, str):
        text = data
    else:
        text = json_in_pieces(data) if large else json.dumps(data, separators=(",", ":"),
                                                              allow_nan=False)
    return f"data: {text}\n\n".encode()


def json_in_pieces(value: Any, ensure_ascii: bool = True, allow_nan: bool = False) -> str:
    """``json.dumps(value, separators=(",", ":"), ...)``: the same text, built
    from slices of at most ``JSON_PIECE_ITEMS`` items of every longer list.

    One C ``json.dumps`` call holds the GIL throughout (~2 us a logprobs
    entry), so a worker thread encoding a large body in one call would stall
    the event loop all that time; between slices it hands the GIL back.
    """
    def dumps(part: Any) -> str:
        return json.dumps(part, separators=(",", ":"), ensure_ascii=ensure_ascii,
                          allow_nan=allow_nan)

    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return "{" + ",".join(f"{dumps(key)}:{json_in_pieces(item, ensure_ascii, allow_nan)}"
                              for key, item in value.items()) + "}"
    if isinstance(value, (list, tuple)) and len(value) > JSON_PIECE_ITEMS:
        return "[" + ",".join(dumps(list(value[i:i + JSON_PIECE_ITEMS]))[1:-1]
                              for i in range(0, len(value), JSON_PIECE_ITEMS)) + "]"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(json_in_pieces(item, ensure_ascii, allow_nan) for item in value) + "]"
    return dumps(value)


# --------------------------------------------------------------------------- generation


@dataclass
class Generation:
    """One admitted request on its way out: the stream and how to render it."""

    engine: EngineClient
    stream: RequestStream
    renderer: Renderer
    accepted: RequestAccepted
    n: int
    log_prompts: bool = False

    async def abort_unless_finished(self) -> None:
        """Abort the request in the engine unless its stream already ended."""
        await abort_unless_finished(self.engine, self.stream)

    async def collect(self, headers: dict[str, str]) -> Response:
        """Read the whole stream; the non-streaming response (a ``JSONResponse``
        built on a worker thread when it lists many logprobs).

        A ``RequestFailed`` mid-way raises a 5xx ``APIError``.
        """
        choices = {i: ChoiceState(i) for i in range(self.n)}
        async for event in self.stream:
            if isinstance(event, RequestFailed):
                raise from_failed(event, status=max(event.status, 500))
            if isinstance(event, RequestOutput):
                choices.setdefault(event.index, ChoiceState(event.index)).add(
                    event, self.renderer.token_text)
        self._log_outputs(choices)
        states = list(choices.values())
        num_tokens = sum(len(c.token_ids) for c in states)
        return await self._maybe_off_loop(
            num_tokens + len(states) * self._echoed_tokens(), self._json_response, states, headers)

    def _json_response(self, choices: list[ChoiceState], headers: dict[str, str],
                       large: bool) -> Response:
        """The ``JSONResponse`` of the finished choices (encoded in pieces when ``large``)."""
        body = self.renderer.response(choices, len(self.accepted.prompt_token_ids))
        if not large:
            return JSONResponse(body, headers=headers)
        text = json_in_pieces(body, ensure_ascii=False, allow_nan=False)
        return Response(text.encode("utf-8"), media_type="application/json", headers=headers)

    def _echoed_tokens(self) -> int:
        """Prompt tokens whose logprobs a choice lists (completions ``echo``)."""
        renderer = self.renderer
        return len(renderer.prompt_token_ids) if renderer.echo else 0

    async def _maybe_off_loop(self, num_tokens: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args, large)``: ``large`` and on a worker thread when it renders
        the logprobs of more than ``OFFLOAD_MIN_LOGPROB_TOKENS`` tokens."""
        if self.renderer.logprobs_top is not None and num_tokens > OFFLOAD_MIN_LOGPROB_TOKENS:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, True))
        return fn(*args, False)

    def _chunk_bytes(self, state: ChoiceState, event: RequestOutput, large: bool) -> bytes | None:
        """The SSE bytes of one output's chunk (None: nothing to send)."""
        chunk = self.renderer.delta_chunk(state, event)
        return None if chunk is None else sse(chunk, large)

    async def _chunk_of(self, choices: dict[int, ChoiceState], event: RequestOutput
                        ) -> bytes | None:
        """The SSE bytes of ``event``'s chunk, its choice's state updated."""
        state = choices.setdefault(event.index, ChoiceState(event.index))
        echoed = 0 if state.echoed else self._echoed_tokens()
        return await self._maybe_off_loop(len(event.token_ids) + echoed, self._chunk_bytes,
                                          state, event)

    def _log_outputs(self, choices: dict[int, ChoiceState]) -> None:
        """With ``--log-prompts`` only: log the generated texts."""
        if self.log_prompts:
            log.info("api_request_output", request_id=self.stream.request_id,
                     outputs=["".join(choices[i].text) for i in sorted(choices)])

    async def events(self) -> AsyncIterator[bytes]:
        """The SSE body: role chunks (chat), deltas, usage chunk, ``[DONE]``.

        A ``RequestFailed`` mid-stream is sent as ``data: {"error": ...}``.
        """
        renderer = self.renderer
        choices = {i: ChoiceState(i) for i in range(self.n)}
        if renderer.kind == "chat":
            for index in range(self.n):
                yield sse(renderer.role_chunk(index))
        # echo with logprobs and n > 1: only sample 0 scores the prompt
        # (``fan_out``), so another choice's first chunk waits for its scores
        waiting: list[RequestOutput] | None = (
            [] if renderer.echo and renderer.logprobs_top is not None and self.n > 1 else None)
        async for event in self.stream:
            if isinstance(event, RequestFailed):
                yield sse(error_body(event.message, event.type, event.param, event.code))
                break
            if isinstance(event, RequestOutput):
                if waiting is not None and renderer.shared_prompt_logprobs is None:
                    if event.prompt_logprobs is None:
                        waiting.append(event)
                        continue
                    ready, waiting = [event, *waiting], None
                else:
                    ready = [event]
                for output in ready:
                    data = await self._chunk_of(choices, output)
                    if data is not None:
                        yield data
        else:
            for output in waiting or ():  # sample 0 never scored it: as it is
                data = await self._chunk_of(choices, output)
                if data is not None:
                    yield data
            if renderer.include_usage:
                yield sse(renderer.usage_chunk(list(choices.values()),
                                               len(self.accepted.prompt_token_ids)))
            self._log_outputs(choices)
        yield sse("[DONE]")


async def _first_event(stream: RequestStream) -> StreamEvent:
    """The stream's first event (normally ``RequestAccepted``)."""
    async for event in stream:
        return event
    raise APIError(500, "The engine closed the stream without an answer", type="server_error")


def _hidden_ids(engine: EngineClient, params: SamplingParams) -> frozenset[int]:
    """Token ids the response text leaves out: the special ones, under
    ``skip_special_tokens`` (none when the engine has no tokenizer)."""
    tokenizer = getattr(engine, "tokenizer", None)
    if not params.skip_special_tokens or tokenizer is None:
        return frozenset()
    return frozenset(getattr(tokenizer, "all_special_ids", ()))


@dataclass(frozen=True)
class Prepared:
    """A validated request ready for the engine, plus how to render the answer."""

    generate: GenerateRequest
    renderer: Renderer
    stream: bool
    log_prompts: bool = False


async def run_generation(request: Request, engine: EngineClient, prepared: Prepared) -> Response:
    """Submit to the engine and answer: an error, a JSON body or an SSE stream.

    The engine is told to abort whenever this returns (or raises) before the
    stream finished, except when the stream is handed to the SSE response,
    which then owns that duty.
    """
    stream = engine.generate(prepared.generate)
    headers = {"X-Request-Id": prepared.generate.request_id}
    handed_off = False
    try:
        gone, first = await unless_disconnected(request.receive, lambda: _first_event(stream))
        if gone:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(first, RequestFailed):  # refused (429, 503, 400): still name the request
            raise from_failed(first, headers=headers)
        if not isinstance(first, RequestAccepted):
            raise APIError(500, "The engine sent output before accepting the request",
                           type="server_error")
        renderer = prepared.renderer
        renderer.prompt_token_ids = tuple(first.prompt_token_ids)
        if renderer.echo and renderer.echo_text is None:
            renderer.echo_text = await anyio.to_thread.run_sync(
                decode_prompt, engine, renderer.prompt_token_ids)
        generation = Generation(engine, stream, renderer, first,
                                prepared.generate.sampling_params.n, prepared.log_prompts)
        if prepared.stream:
            handed_off = True
            return EventStreamResponse(generation.events(), generation.abort_unless_finished,
                                       headers=headers)
        gone, response = await unless_disconnected(request.receive,
                                                   lambda: generation.collect(headers))
        if gone:
            return Response(status_code=CLIENT_CLOSED)
        return response
    finally:
        if not handed_off:
            with anyio.CancelScope(shield=True):
                await abort_unless_finished(engine, stream)


async def abort_unless_finished(engine: EngineClient, stream: RequestStream) -> None:
    """Tell the engine to drop a request whose stream has not ended
    (client gone, error while answering); logs ``api_request_aborted``."""
    if stream.all_finished:
        return
    log.info("api_request_aborted", request_id=stream.request_id)
    await engine.abort(stream.request_id)


def decode_prompt(engine: EngineClient, token_ids: tuple[int, ...]) -> str:
    """The text of a token-id prompt (for ``echo``), special tokens included."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        return ""
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def new_request_id(prefix: str) -> str:
    """``<prefix>-<uuid4 hex>``, e.g. ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def served_model(engine: EngineClient, config: ServerConfig) -> str:
    """The model name clients see (``--served-model-name`` or the engine's)."""
    return config.served_model_name or engine.model_name


def check_model(name: str | None, engine: EngineClient, config: ServerConfig) -> None:
    """404 ``model_not_found`` unless ``name`` is unset or a name we serve."""
    if name is None or name in (engine.model_name, served_model(engine, config)):
        return
    raise APIError(404, f"The model `{name}` does not exist; this server serves "
                        f"`{served_model(engine, config)}`.", param="model",
                   code="model_not_found")


def check_chat_template(engine: EngineClient) -> None:
    """400 naming ``messages`` when the engine's tokenizer has no chat template
    (a base model's GGUF has none): the message says so and names
    ``--chat-template`` (with the template kvserve ships for the model, its
    tokenizer's ``chat_template_hint``: Gemma 3's); completions are unaffected. An engine whose
    tokenizer does not say (no ``chat_template`` attribute) is let through."""
    from kvserve.model.tokenizer import NO_CHAT_TEMPLATE

    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "chat_template") and not tokenizer.chat_template:
        hint = getattr(tokenizer, "chat_template_hint", None)
        raise APIError(400, f"Chat completions need a chat template, and {NO_CHAT_TEMPLATE}"
                            + (f" (for this model: --chat-template {hint})" if hint else "") + ".",
                       param="messages", code="chat_template_missing")


def prepare(kind: str, body: ChatCompletionRequest | CompletionRequest, headers: RequestHeaders,
            engine: EngineClient, config: ServerConfig) -> Prepared:
    """Turn a validated body and its headers into a ``GenerateRequest`` and renderer."""
    check_model(body.model, engine, config)
    template = getattr(getattr(engine, "tokenizer", None), "chat_template", None)
    tool_format = resolve_format(config.tool_call_parser, template)
    params = sampling_params_or_400(body, config.generation_defaults, tool_format)
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    request_id = headers.request_id or new_request_id(prefix)
    inputs: dict[str, Any]
    if isinstance(body, ChatCompletionRequest):
        check_chat_template(engine)
        try:
            body.check_template_fields()
        except ValueError as exc:
            message = str(exc)
            raise APIError(400, message, param=message.split(":", 1)[0]) from exc
        native = template_knows_tools(template)
        tools = body.active_tools() if native else None
        kwargs = {**(body.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        inputs = {"messages": tuple(body.template_messages(native)),
                  "chat_template_kwargs": kwargs or None,
                  "add_generation_prompt": body.add_generation_prompt,
                  "continue_final_message": body.continue_final_message}
    else:
        try:
            text, token_ids = body.prompt_input()
        except ValueError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        inputs = {"prompt": text, "prompt_token_ids": token_ids,
                  "parse_special": body.parse_special}
    priority = headers.priority if headers.priority is not None else body.priority
    generate = GenerateRequest(request_id=request_id, sampling_params=params,
                               arrival_time=time.monotonic(), priority=priority,
                               request_class=headers.request_class, stream=body.stream,
                               **inputs)
    echo = isinstance(body, CompletionRequest) and body.echo
    renderer = Renderer(kind, request_id, served_model(engine, config), token_text_for(engine),
                        logprobs_top=params.logprobs, include_usage=body.include_usage,
                        continuous_usage=body.continuous_usage,
                        token_bytes=token_bytes_for(engine), echo=echo,
                        echo_text=inputs.get("prompt") if echo else None,
                        hidden_token_ids=_hidden_ids(engine, params),
                        tools=body.tool_reply(tool_format.name)
                        if isinstance(body, ChatCompletionRequest) else None,
                        reasoning=config.reasoning_parser if kind == "chat" else None)
    if config.log_prompts:
        log.info("api_request_prompt", request_id=request_id, prompt=inputs.get("prompt"),
                 prompt_token_ids=inputs.get("prompt_token_ids"),
                 messages=inputs.get("messages"), sampling_params=repr(params))
    return Prepared(generate, renderer, body.stream, config.log_prompts)
