"""The ASGI server: uvicorn, with connection limits and a graceful drain on SIGTERM.

uvicorn because it is the standard ASGI server for Starlette, runs on uvloop,
and is maintained; a server of our own would add nothing we need. The limits
uvicorn lacks (timeouts on a request's head and body and on a new idle
connection, a connection bound) are timers on its own h11 protocol
(``kvserve.api.connections``).
"""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

import uvicorn
import structlog

from kvserve.api.connections import protocol_class
from kvserve.config import ServerConfig

log = structlog.get_logger("kvserve.server")

#: File descriptors kept for everything but client connections (model files,
#: pipes, the listening socket, threads' eventfds).
RESERVED_FDS = 256
#: Seconds past ``--drain-timeout`` after which a shutdown that has not
#: finished (a thread still tokenizing or compiling, a hung library call)
#: ends the process anyway.
FORCED_EXIT_GRACE = 4.0
#: Exit status of such a forced exit (a clean shutdown exits 0).
FORCED_EXIT_STATUS = 1


def uvicorn_config(app, server: ServerConfig) -> uvicorn.Config:
    """uvicorn's settings for ``server``: its h11 protocol with our limits
    (``GuardedH11Protocol``), h11's bound on an incomplete head, the
    keep-alive timeout, no access log (the engine logs every request)."""
    return uvicorn.Config(app, host=server.host, port=server.port, log_config=None,
                          access_log=False, timeout_graceful_shutdown=5,
                          http=protocol_class(server),
                          timeout_keep_alive=server.timeout_keep_alive,  # type: ignore[arg-type]
                          h11_max_incomplete_event_size=server.max_header_bytes)


def fit_file_limit(max_connections: int) -> int:
    """Raise the soft open-file limit to the hard one (as vLLM does), and
    return ``max_connections``, lowered (with a warning) so that the
    connections and ``RESERVED_FDS`` fit the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    fits = max(1, soft - RESERVED_FDS)
    if max_connections > fits:
        log.warning("max_connections_lowered", max_connections=fits, requested=max_connections,
                    open_file_limit=soft, message=f"--max-connections lowered to {fits}: the "
                    f"open-file limit is {soft}")
        return fits
    return max_connections


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but a shutdown signal first drains the engine.

    On SIGTERM the engine stops admitting (new requests get 503), accepted
    requests run to completion for up to ``drain_timeout`` seconds (the rest
    end with a 503 error event), then uvicorn shuts down and the process exits
    with status 0. SIGINT (Ctrl-C) does the same without waiting: open
    streams end at once with a 503 error event and ``[DONE]`` (uvicorn alone
    cancelled them after 5 s, with a traceback and a cut stream). A second
    signal is uvicorn's forced exit.

    Whatever still runs then (a long prompt on a tokenizer thread, a
    constraint compile, a library call that does not return), the process
    ends ``FORCED_EXIT_GRACE`` seconds after the drain's deadline: a
    watchdog thread armed by the first signal logs ``shutdown_forced`` and
    calls ``exit_process`` (``os._exit``) with ``FORCED_EXIT_STATUS``.
    """

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float,
                 exit_process: Callable[[int], None] = os._exit) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.exit_process = exit_process
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig not in (signal.SIGTERM, signal.SIGINT) or self._loop is None or self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True  # not re-raised after shutdown: we exit 0
        timeout = self.drain_timeout if sig == signal.SIGTERM else 0.0
        name = "sigterm_received" if sig == signal.SIGTERM else "sigint_received"
        log.info(name, drain_timeout_s=timeout)
        self._arm_watchdog(timeout + FORCED_EXIT_GRACE)
        self._loop.call_soon_threadsafe(self._start_drain, timeout)

    def _arm_watchdog(self, seconds: float) -> threading.Timer:
        """End the process in ``seconds`` unless it ended by itself."""
        watchdog = threading.Timer(seconds, self._force_exit, args=(seconds,))
        watchdog.daemon = True
        watchdog.start()
        return watchdog

    def _force_exit(self, seconds: float) -> None:
        log.error("shutdown_forced", seconds=seconds, status=FORCED_EXIT_STATUS,
                  message=f"Shutdown did not finish within {seconds:g} s of the signal "
                          f"(--drain-timeout + {FORCED_EXIT_GRACE:g} s): exiting now")
        sys.stderr.flush()
        self.exit_process(FORCED_EXIT_STATUS)

    def _start_drain(self, timeout: float) -> None:
        asyncio.ensure_future(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        try:
            await self.engine.drain(timeout)
        finally:
            self.should_exit = True
