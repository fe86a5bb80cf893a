"""One log line per refused HTTP request: ``http_refused``.

A request the API answers with a 4xx or 5xx status before (or instead of)
reaching the engine -- a wrong model name, a malformed body, a bad field,
a 404 path, a 401 -- otherwise leaves no trace in the server's log: the
engine's ``request_*`` lines start only once a request is accepted, and
uvicorn's access log is off. :class:`RefusalLogMiddleware` logs
``http_refused`` at ``info`` with the method, path, status and the error's
message (the ``error.message`` of the OpenAI-style JSON body, cut to
``MAX_MESSAGE_CHARS``), the role of the access-log line a vLLM user reads
(``"POST /v1/chat/completions HTTP/1.1" 400``). Requests the engine
rejected itself (``request_rejected``, logged by the tokenizer actor) are
logged here too, with the HTTP status they got. Status 499 (the client left
while sending its body) is not a refusal and has its own line,
``client_disconnected``.
"""

from __future__ import annotations

import json

import structlog
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.core.structured_outputs import log_safe

log = structlog.get_logger("kvserve.api")

#: Longest error message copied into the log line (characters).
MAX_MESSAGE_CHARS = 300
#: nginx's status for a client that left (``kvserve.api.connections``): not a refusal.
CLIENT_LEFT = 499
#: Bytes of a refusal's body read for its message (error bodies are small).
_MAX_BODY_BYTES = 4096


def error_message(body: bytes) -> str | None:
    """``error.message`` of an OpenAI-style error body (``{"error": {"message":
    ...}}``), cut to ``MAX_MESSAGE_CHARS``; None for another body."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    error = doc.get("error") if isinstance(doc, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return message[:MAX_MESSAGE_CHARS] if isinstance(message, str) else None


class RefusalLogMiddleware:
    """ASGI middleware: logs ``http_refused`` (method, path, status,
    message) for every HTTP response with a status of 400 or more but 499."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def watching_send(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 \
                    and len(body) < _MAX_BODY_BYTES:
                body += message.get("body", b"")[:_MAX_BODY_BYTES - len(body)]
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            if status >= 400 and status != CLIENT_LEFT:
                log.info("http_refused", method=scope.get("method"), path=scope.get("path"),
                         status=status, error=log_safe(error_message(body)))
