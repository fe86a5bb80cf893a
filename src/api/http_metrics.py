"""HTTP request metrics: a pure ASGI middleware that times every request and
hands ``(handler, method, status, seconds)`` to a recorder
(``kvserve.observability.metrics.ServerMetrics``).

Follows prometheus-fastapi-instrumentator (which vLLM's server uses):
``handler`` is the matched route's path template (``/v1/chat/completions``)
or ``"none"`` for a path no route matches, so a client-chosen path never adds
a series; the status is the one of ``http.response.start``; the duration
ends with the response's last body message (or when the app returns).

Decisions where the instrumentator has none or differs:

- a request whose response never started counts as status 500 (the app
  raised, and Starlette's error middleware, outside this one, answers 500;
  or it returned without answering, and uvicorn answers 500);
- a request whose client left is counted with the status the app gave it:
  499 (``kvserve.api.serving.CLIENT_CLOSED``) when it left before the
  response, the response's status (say, 200) when it left during a stream;
- ``method`` is one of ``KNOWN_METHODS`` or ``"other"`` (h11 takes any
  token as a method; the instrumentator labels it as sent);
- a method a route does not allow (405) still gets the route's template;
- ``EXCLUDED_HANDLERS`` (the probe and scrape paths) are not counted, as
  vLLM excludes its ``/metrics`` and ``/health``.

Connections refused before a request reaches the app (503 above
``--max-connections``, 408 timeouts, 400 for malformed framing; see
``kvserve.api.connections``) never reach this middleware and are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The ``handler`` of a request no route matches.
UNMATCHED = "none"
#: Methods labelled as themselves; any other is ``"other"``.
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
#: Route templates not counted (probes and scrapers).
EXCLUDED_HANDLERS = frozenset({"/health", "/metrics"})


class HttpRecorder(Protocol):
    """Where the middleware reports each request (``ServerMetrics``)."""

    def observe_http(self, handler: str, method: str, status: int, seconds: float) -> None: ...


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route Starlette's router picks for
    ``scope`` (the first full match, else the first path-only match, which
    Starlette answers 405), or ``UNMATCHED``."""
    partial = None
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return getattr(route, "path", UNMATCHED)
        if match is Match.PARTIAL and partial is None:
            partial = getattr(route, "path", UNMATCHED)
    return partial or UNMATCHED


class HttpMetricsMiddleware:
    """ASGI middleware: one ``recorder.observe_http`` call per HTTP request
    to a route not in ``EXCLUDED_HANDLERS`` (see the module docstring for
    what is counted how). ``routes`` are the app's routes, for the template."""

    def __init__(self, app: ASGIApp, recorder: HttpRecorder,
                 routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.recorder = recorder
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        handler = route_template(self.routes, scope)
        if handler in EXCLUDED_HANDLERS:
            await self.app(scope, receive, send)
            return
        method = scope["method"] if scope["method"] in KNOWN_METHODS else "other"
        start = time.perf_counter()
        status, end = 500, None

        async def timed_send(message: Message) -> None:
            nonlocal status, end
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                end = time.perf_counter()
            await send(message)

        try:
            await self.app(scope, receive, timed_send)
        finally:
            seconds = (end if end is not None else time.perf_counter()) - start
            self.recorder.observe_http(handler, method, status, seconds)


def instrument(app: Starlette, recorder: HttpRecorder) -> Starlette:
    """Add ``HttpMetricsMiddleware`` as ``app``'s outermost middleware (so
    401, 431 and every other refusal of the app is counted); returns ``app``."""
    app.add_middleware(HttpMetricsMiddleware, recorder=recorder, routes=app.routes)
    return app
