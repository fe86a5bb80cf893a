"""Connection hygiene: uvicorn's h11 protocol with the limits it lacks.

uvicorn (0.54) has a keep-alive idle timeout (``timeout_keep_alive``, armed
only *after* a response) and a bound on a request head that arrives in pieces
(``h11_max_incomplete_event_size``). It has no timeout on a connection that
never sends a request, none on a request head or body that trickles in, and
no bound on open connections: idle or slow sockets were held until the
process ran out of file descriptors. ``GuardedH11Protocol`` adds exactly
these, as timers and a count on uvicorn's own per-connection protocol object
(the HTTP parsing stays uvicorn's and h11's):

- **idle**: a new connection gets the keep-alive timer uvicorn gives one
  between requests, so a socket that sends nothing is closed after
  ``timeout_keep_alive`` seconds;
- **request head**: from the head's first byte to its end, at most
  ``timeout_request_head``;
- **request body**: from the head to the body's last byte, at most
  ``timeout_request_body``; a timed-out request gets 408 if no response has
  started (nginx's ``client_header_timeout`` / ``client_body_timeout`` have
  the same job, there as per-read timers);
- **connections**: above ``max_connections`` open connections a new one is
  answered 503 and closed before anything is read from it;
- **framing**: a request whose body length is ambiguous (RFC 9112, section
  6.3: both ``Content-Length`` and ``Transfer-Encoding``; section 6.1:
  ``Transfer-Encoding`` in HTTP/1.0) is answered 400 and the connection
  closed before the app sees it, so no request hidden in its body runs
  (request smuggling). h11 itself rejects the other ambiguities (two
  different ``Content-Length`` values, a ``Transfer-Encoding`` other than
  ``chunked`` alone); every such 400 gets the JSON error body too.

The header-size bound of a head that arrives whole is ``HeaderSizeLimit``,
an ASGI middleware (h11 bounds only a head that is still incomplete).
"""

from __future__ import annotations

import asyncio
import json
import time

import h11
import structlog
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvserve.api.errors import error_body
from kvserve.config import ServerConfig

log = structlog.get_logger("kvserve.server")

#: Seconds between two ``connections_refused`` log lines (an attack must not flood the log).
REFUSAL_LOG_INTERVAL = 10.0


def raw_error_response(status: int, reason: str, message: str, type_: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with an OpenAI-shaped
    JSON error body, written straight to a socket (no h11 state involved)."""
    body = json.dumps(error_body(message, type_)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


def framing_problem(request: h11.Request) -> str | None:
    """Why ``request``'s message framing is ambiguous, or None when it is not.

    Only what h11 (0.16) lets through: ``Content-Length`` with
    ``Transfer-Encoding`` (RFC 9112, section 6.3, item 3: "ought to be
    handled as an error"; a server "MUST close the connection after
    responding") and ``Transfer-Encoding`` in an HTTP/1.0 request (section
    6.1: "MUST treat the message as if the framing is faulty"). h11 gives
    header names in lower case.
    """
    names = {name for name, _ in request.headers}
    if b"transfer-encoding" not in names:
        return None
    if b"content-length" in names:
        return "The request has both Content-Length and Transfer-Encoding."
    if request.http_version == b"1.0":
        return "Transfer-Encoding is not allowed in an HTTP/1.0 request."
    return None


class FramingCheckedConnection(h11.Connection):
    """h11's server connection that also rejects the requests of
    ``framing_problem``, as h11 rejects a malformed one: ``next_event``
    raises ``h11.RemoteProtocolError`` (uvicorn then answers 400 and
    closes). ``rejection`` keeps the reason of the last rejection, h11's
    own included, for the response body."""

    rejection: str | None = None

    def next_event(self):  # type: ignore[override]
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.rejection = str(exc)
            raise
        problem = framing_problem(event) if isinstance(event, h11.Request) else None
        if problem is not None:
            self.rejection = problem
            raise h11.RemoteProtocolError(problem, 400)
        return event


class _RefusalLog:
    """Counts refused connections; logs at most one line per interval."""

    def __init__(self) -> None:
        self.total = 0
        self._unlogged = 0
        self._last = float("-inf")

    def refused(self, open_connections: int, limit: int) -> None:
        self.total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last >= REFUSAL_LOG_INTERVAL:
            log.warning("connections_refused", refused=self._unlogged, total_refused=self.total,
                        open_connections=open_connections, max_connections=limit,
                        message=f"Refused {self._unlogged} connection(s) with 503: "
                                f"{open_connections} open, --max-connections {limit}")
            self._last, self._unlogged = now, 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus an idle timer on new connections, head and
    body deadlines and a connection bound (see the module docstring).

    Subclass it with ``protocol_class(server_config)``; uvicorn creates one
    instance per connection.
    """

    limits: ServerConfig = ServerConfig()
    refusals: _RefusalLog = _RefusalLog()

    def __init__(self, config, server_state, app_state, _loop=None) -> None:
        """uvicorn's set-up, with h11's connection replaced by a
        ``FramingCheckedConnection`` of the same size bound."""
        super().__init__(config, server_state, app_state, _loop)
        size = config.h11_max_incomplete_event_size  # as uvicorn builds its connection
        self.conn = FramingCheckedConnection(
            h11.SERVER, **({} if size is None else {"max_incomplete_event_size": size}))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        if len(self.connections) > self.limits.max_connections:
            self.refusals.refused(len(self.connections) - 1, self.limits.max_connections)
            self._refuse(503, "Service Unavailable", "The server has too many open "
                         "connections; retry later.", "service_unavailable")
            return
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self._follow_request()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _follow_request(self) -> None:
        """Arm the deadline of the part of the request being read now (an
        idle connection has uvicorn's keep-alive timer instead)."""
        state = self.conn.their_state
        if self.transport.is_closing():
            self._arm(None)
        elif state is h11.IDLE:
            self._arm("head" if self.conn.trailing_data[0] else None)
        else:
            self._arm("body" if state is h11.SEND_BODY else None)

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            seconds = (self.limits.timeout_request_head if phase == "head"
                       else self.limits.timeout_request_body)
            self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline, self._phase = None, None
        if self.transport.is_closing():
            return
        log.info("request_timeout", phase=phase, timeout_s=seconds,
                 client=f"{self.client[0]}:{self.client[1]}" if self.client else None)
        self._refuse(408, "Request Timeout", f"The request {phase} did not arrive within "
                     f"{seconds:g} s.", "timeout")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 (or ``FramingCheckedConnection``)
        rejects: 400 with the reason in an OpenAI-shaped JSON body, then close."""
        reason = self.conn.rejection  # type: ignore[attr-defined]  # set in __init__
        self._refuse(400, "Bad Request", f"Invalid HTTP request: {reason or msg}",
                     "invalid_request_error")

    def _refuse(self, status: int, reason: str, message: str, type_: str) -> None:
        """Answer ``status`` and close; a request the app is reading sees a
        disconnect (its later sends are dropped). If the app's response has
        started already (say, 401 before the body), only close."""
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or not cycle.response_started or cycle.response_complete:
            self.transport.write(raw_error_response(status, reason, message, type_))
        self.transport.close()


def protocol_class(limits: ServerConfig) -> type[GuardedH11Protocol]:
    """A ``GuardedH11Protocol`` bound to ``limits`` (pass it as uvicorn's ``http``)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,),
                {"limits": limits, "refusals": _RefusalLog()})


class HeaderSizeLimit:
    """ASGI middleware: 431 when the request head's header lines total more
    than ``max_bytes`` (name + value + 4 bytes of ``: `` and CRLF each).

    RFC 6585, section 5 (431 Request Header Fields Too Large).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) + 4 for name, value in scope["headers"])
            if size > self.max_bytes:
                from starlette.responses import JSONResponse

                body = error_body(f"The request headers total {size} bytes, more than "
                                  f"--max-header-bytes {self.max_bytes}.", "invalid_request_error")
                await JSONResponse(body, status_code=431)(scope, receive, send)
                return
        await self.app(scope, receive, send)
