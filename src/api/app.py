"""The Starlette application: OpenAI-compatible routes, auth and errors.

Routes (OpenAI API reference, https://platform.openai.com/docs/api-reference):
``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /v1/models/{model}`` and ``GET /health`` (200 when the engine is ready,
else 503). vLLM's extensions: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.
While the model loads, ``LoadingGate`` answers in the app's place: ``/health``
503 ``{"status": "loading"}``, every other path 503 (llama.cpp's "Loading model").
"""

from __future__ import annotations

import functools
import hmac
import json
import time
from collections.abc import Sequence
from importlib import metadata

import anyio

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.actors.stream import EngineClient
from kvserve.api.connections import HeaderSizeLimit
from kvserve.api.errors import EXCEPTION_HANDLERS, APIError, error_body
from kvserve.api.refusal_log import RefusalLogMiddleware
from kvserve.api.responses import (CHAT_TO_RESPONSES_PARAM, EventWriter, ResponseStore,
                                   chat_chunks, created_now, new_id, response_object,
                                   response_shell, stream_events, to_chat_body)
from kvserve.api.tool_calls import render_messages
from kvserve.api.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kvserve.api.serving import (
    EventStreamResponse,
    RequestHeaders,
    check_model,
    parse_model,
    prepare,
    read_json_body,
    refuse_message_flood,
    run_generation,
    served_model,
)
from kvserve.config import ServerConfig

#: Paths that never need the API key (probes and scrapers).
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class BearerAuth:
    """ASGI middleware: require ``Authorization: Bearer <api_key>`` (the
    scheme in any case, RFC 7235).

    Compares the key with ``hmac.compare_digest``; answers 401 with OpenAI's
    ``invalid_api_key`` error otherwise. ``PUBLIC_PATHS`` are exempt.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS or self._ok(scope):
            await self.app(scope, receive, send)
            return
        body = error_body("Incorrect API key provided.", code="invalid_api_key")
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)

    def _ok(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # The auth scheme is case-insensitive (RFC 7235, section 2.1).
                return scheme.lower() == b"bearer" and hmac.compare_digest(token, self.expected)
        return False


#: Seconds a client is told to wait (``Retry-After``) while the model loads.
LOADING_RETRY_AFTER = 1


class LoadingGate:
    """The ASGI app the server runs from before the model loads: the port
    answers from the first second of a start, as llama.cpp's server does.

    Until ``open(app)``: ``GET /health`` (any method) answers 503 with
    ``{"status": "loading"}``; every other HTTP path 503 with OpenAI's error
    body (type ``service_unavailable``) and ``Retry-After``; a websocket is
    closed. After it, every request goes to ``app``. Lifespan events are
    answered here in both states (``build_app``'s app has no start-up or
    shutdown handlers).
    """

    def __init__(self) -> None:
        self.app: ASGIApp | None = None

    def open(self, app: ASGIApp) -> None:
        """Hand every later request to ``app`` (the engine is ready)."""
        self.app = app

    @property
    def loading(self) -> bool:
        """True until ``open``."""
        return self.app is None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _answer_lifespan(receive, send)
        elif self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "http":
            await _loading_response(scope["path"])(scope, receive, send)
        else:  # websocket: no such route while loading either
            await send({"type": "websocket.close", "code": 1013})  # "try again later"


def _loading_response(path: str) -> Response:
    """The 503 for ``path`` while the model loads."""
    headers = {"Retry-After": str(LOADING_RETRY_AFTER)}
    if path == "/health":
        return JSONResponse({"status": "loading"}, status_code=503, headers=headers)
    return JSONResponse(error_body("The model is loading; retry when /health answers 200.",
                                   "service_unavailable"), status_code=503, headers=headers)


async def _answer_lifespan(receive: Receive, send: Send) -> None:
    """Complete the ASGI lifespan protocol's start-up and shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def build_app(engine: EngineClient, server_config: ServerConfig, *,
              extra_routes: Sequence[BaseRoute] = ()) -> Starlette:
    """Build the HTTP app around ``engine``.

    ``extra_routes`` (for example ``/metrics``) are added after the OpenAI
    routes. With ``server_config.api_key`` set, every path except ``/health``
    and ``/metrics`` needs the bearer key. Headers over
    ``server_config.max_header_bytes`` get 431 before anything else.
    """
    routes = [
        *_completion_routes(engine, server_config),
        *_responses_routes(engine, server_config),
        *_model_routes(engine, server_config),
        *_health_routes(engine),
        *_vllm_routes(engine, server_config),
        *extra_routes,
    ]
    app = Starlette(routes=routes, exception_handlers=dict(EXCEPTION_HANDLERS))
    app.state.engine = engine
    app.state.server_config = server_config
    _add_middleware(app, server_config)
    return app


def _add_middleware(app: Starlette, server_config: ServerConfig) -> None:
    """Wrap ``app``, innermost first: the bearer key (when set), the header
    size limit (431), then the refusal log, outermost, which sees 401 and
    431 too."""
    if server_config.api_key:
        app.add_middleware(BearerAuth, api_key=server_config.api_key)
    app.add_middleware(HeaderSizeLimit, max_bytes=server_config.max_header_bytes)
    app.add_middleware(RefusalLogMiddleware)  # outermost: sees 401 and 431 too


def _completion_routes(engine: EngineClient, server_config: ServerConfig) -> list[BaseRoute]:
    """``POST /v1/chat/completions`` and ``POST /v1/completions``."""

    async def chat_completions(request: Request) -> Response:
        """``POST /v1/chat/completions`` (OpenAI chat API)."""
        return await _generate(request, "chat", ChatCompletionRequest)

    async def completions(request: Request) -> Response:
        """``POST /v1/completions`` (OpenAI legacy completions API)."""
        return await _generate(request, "completion", CompletionRequest)

    async def _generate(request: Request, kind: str, model_cls: type) -> Response:
        data = await read_json_body(request, server_config.max_request_bytes)
        refuse_message_flood(data, engine)
        body = parse_model(model_cls, data)
        prepared = prepare(kind, body, RequestHeaders.parse(request), engine, server_config)
        return await run_generation(request, engine, prepared)

    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]


def _responses_routes(engine: EngineClient, server_config: ServerConfig) -> list[BaseRoute]:
    """``POST /v1/responses`` and ``GET /v1/responses/{response_id}``, over
    one ``ResponseStore``."""
    store = ResponseStore()

    async def responses(request: Request) -> Response:
        """``POST /v1/responses`` (OpenAI's Responses API, ``kvserve.api.
        responses``): the chat request it means, rendered as a ``response``
        object or its typed events."""
        data = await read_json_body(request, server_config.max_request_bytes)
        if not isinstance(data, dict):
            raise APIError(400, "the body must be a JSON object")
        chat, messages = to_chat_body(data, store)
        if chat["stream"]:
            chat["stream_options"] = {"include_usage": True}
        try:
            refuse_message_flood(chat, engine)
            body = parse_model(ChatCompletionRequest, chat)
            prepared = prepare("chat", body, RequestHeaders.parse(request), engine,
                               server_config)
        except APIError as exc:  # name the Responses field, not the chat one
            param = CHAT_TO_RESPONSES_PARAM.get(exc.param or "", exc.param)
            if param != exc.param:
                message = str(exc.message).replace(exc.param, param, 1)
                if param == "max_output_tokens":
                    message = message.replace("max_tokens", "max_output_tokens")
                raise APIError(exc.status, message, param=param, type=exc.type,
                               code=exc.code) from exc
            raise
        response_id = new_id("resp")
        model = served_model(engine, server_config)
        answer = await run_generation(request, engine, prepared)
        keep = data.get("store", True) is not False

        def remember(response: dict, answer_messages: list) -> None:
            if keep:
                store.put(response, messages, answer_messages)

        if isinstance(answer, EventStreamResponse):
            shell = response_shell(response_id, data, model, created_now(), "in_progress")
            events = stream_events(EventWriter(shell), chat_chunks(answer.events), remember)
            return EventStreamResponse(events, answer.on_close, headers=dict(
                (k.decode(), v.decode()) for k, v in answer.raw_headers
                if k.lower() == b"x-request-id"))
        if answer.status_code != 200:
            return answer
        response, answer_messages = response_object(json.loads(answer.body), data,
                                                    response_id, model)
        remember(response, answer_messages)
        return JSONResponse(response, headers={"X-Request-Id": prepared.generate.request_id})

    async def get_response(request: Request) -> Response:
        """``GET /v1/responses/{id}``: a stored response (404 when not held)."""
        return JSONResponse(store.response(request.path_params["response_id"]))

    return [
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    ]


def _model_routes(engine: EngineClient, server_config: ServerConfig) -> list[BaseRoute]:
    """``GET /v1/models`` and ``GET /v1/models/{model}``."""
    created = int(time.time())

    def model_card() -> dict:
        """OpenAI's model object for the served model, with ``root`` and
        ``max_model_len`` (vLLM's extras)."""
        return {"id": served_model(engine, server_config), "object": "model",
                "created": created, "owned_by": "kvserve", "root": engine.model_name,
                "max_model_len": engine.max_model_len}

    async def models(request: Request) -> Response:
        """``GET /v1/models``: the one served model, with ``max_model_len``."""
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request: Request) -> Response:
        """``GET /v1/models/{model}`` (OpenAI's "Retrieve model",
        https://platform.openai.com/docs/api-reference/models/retrieve): the
        card ``/v1/models`` lists, for the served name or the engine's (the
        names requests may give, ``check_model``); else 404
        ``model_not_found``. The name may hold slashes (``org/name``)."""
        check_model(request.path_params["model"], engine, server_config)
        return JSONResponse(model_card())

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
    ]


def _health_routes(engine: EngineClient) -> list[BaseRoute]:
    """``GET /health``."""

    async def health(request: Request) -> Response:
        """``GET /health``: 200 when the engine is ready (``degraded``, with
        the replicas down, while a data-parallel replica restarts and others
        serve), else 503 saying why: the engine failed, is not ready, is
        stalled (requests running or waiting and no step finished for
        ``--stall-timeout`` seconds: ``kvserve.core.stall``), did not answer
        the check, or cannot compute now (``unavailable``: every replica, or
        a pipeline stage, is down; the body names them)."""
        if engine.is_ready():
            stalled = await _stall_reason(engine)
            if stalled is None:
                status = getattr(engine, "health", None)
                body = status() if status is not None else {"status": "ok"}
                return JSONResponse(body, status_code=503 if body.get("status") == "unavailable"
                                    else 200)
            message = f"The engine is stalled: {stalled}"
        else:
            reason = getattr(engine, "dead_reason", None)
            message = f"The engine failed: {reason}" if reason else "The engine is not ready"
        return JSONResponse(error_body(message, "service_unavailable"), status_code=503)

    return [Route("/health", health, methods=["GET"])]


def _vllm_routes(engine: EngineClient, server_config: ServerConfig) -> list[BaseRoute]:
    """vLLM's extensions: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``."""

    async def tokenize(request: Request) -> Response:
        """``POST /tokenize`` (vLLM): ``{"prompt"}`` or ``{"messages"}`` ->
        ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        data = await read_json_body(request, server_config.max_request_bytes)
        refuse_message_flood(data, engine)
        body = parse_model(TokenizeRequest, data)
        check_model(body.model, engine, server_config)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "Send exactly one of 'prompt' and 'messages'.",
                           param="prompt" if body.prompt is None else "messages")
        tokenizer = _tokenizer(engine)
        tokens = await anyio.to_thread.run_sync(_tokenize, tokenizer, body)
        token_strs = None
        if body.return_token_strs:
            token_strs = tokenizer.convert_ids_to_tokens(tokens)
        return JSONResponse({"count": len(tokens), "max_model_len": engine.max_model_len,
                             "tokens": tokens, "token_strs": token_strs})

    async def detokenize(request: Request) -> Response:
        """``POST /detokenize`` (vLLM): ``{"tokens": [ids]}`` -> ``{"prompt": text}``,
        special tokens included."""
        data = await read_json_body(request, server_config.max_request_bytes)
        body = parse_model(DetokenizeRequest, data)
        check_model(body.model, engine, server_config)
        tokenizer = _tokenizer(engine)
        vocab = getattr(tokenizer, "vocab_size", None)
        bad = [t for t in body.tokens if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is out of vocabulary [0, {vocab}).",
                           param="tokens")
        # special tokens stay in the text, as vLLM's /detokenize keeps them
        text = await anyio.to_thread.run_sync(functools.partial(
            tokenizer.decode, body.tokens, skip_special_tokens=False))
        return JSONResponse({"prompt": text})

    async def version(request: Request) -> Response:
        """``GET /version`` (vLLM): ``{"version": "<kvserve version>"}``."""
        return JSONResponse({"version": _version()})

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]


async def _stall_reason(engine: EngineClient) -> str | None:
    """Why the engine counts as stalled (its ``check_health`` reading, or no
    answer to it), or None when it is not (or cannot tell)."""
    check = getattr(engine, "check_health", None)
    if check is None:
        return None
    reading = await check()
    if reading is None:
        return "the scheduler did not answer a health check"
    return reading.reason() if reading.is_stalled else None


def _tokenizer(engine: EngineClient):
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        raise APIError(501, "This engine has no tokenizer.", type="server_error")
    return tokenizer


def _tokenize(tokenizer, body: TokenizeRequest) -> list[int]:
    """Token ids of a ``/tokenize`` body, as the engine would tokenize the prompt."""
    if body.messages is not None:
        if not body.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        try:  # as the engine does: message contents are text
            messages = render_messages([m.to_dict() for m in body.messages], None)
            return list(tokenizer.encode_chat(messages,
                                              add_generation_prompt=body.add_generation_prompt))
        except ValueError as exc:
            raise APIError(400, f"Cannot apply the chat template: {exc}",
                           param="messages") from exc
    return list(tokenizer.encode(body.prompt or "", add_special_tokens=body.add_special_tokens,
                                 parse_special=body.parse_special))


def _version() -> str:
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        from kvserve import __version__
        return __version__
