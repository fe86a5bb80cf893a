"""The ASGI server: uvicorn, with connection limits and a graceful drain on SIGTERM.

uvicorn because it is the standard ASGI server for Starlette, runs on uvloop,
and is maintained; a server of our own would add nothing we need. The limits
uvicorn lacks (timeouts on a request's head and body and on a new idle
connection, a connection bound) are timers on its own h11 protocol
(``kvserve.api.connections``).

The CLI binds the port itself first (``bind_socket``), so a busy port is one
line before anything loads, and hands the socket to uvicorn, which serves
``kvserve.api.app.LoadingGate`` while the model loads.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import resource
import signal
import socket
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
#: ends the process anyway; ``KVSERVE_SHUTDOWN_GRACE_S`` in the environment
#: sets another (a machine so loaded that a clean stop takes longer: the
#: suite's drain tests, which judge a stop by its cause, not its time).
FORCED_EXIT_GRACE = 4.0
SHUTDOWN_GRACE_ENV = "KVSERVE_SHUTDOWN_GRACE_S"


def forced_exit_grace() -> float:
    """``FORCED_EXIT_GRACE``, or the positive seconds ``KVSERVE_SHUTDOWN_GRACE_S`` gives."""
    try:
        seconds = float(os.environ.get(SHUTDOWN_GRACE_ENV, ""))
    except ValueError:
        return FORCED_EXIT_GRACE
    return seconds if seconds > 0 else FORCED_EXIT_GRACE
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


class PortUnavailable(OSError):
    """The host and port cannot be bound; the message is one line for people."""


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening; uvicorn
    listens on it), as uvicorn's ``Config.bind_socket`` makes it: IPv6 when
    ``host`` holds a colon, ``SO_REUSEADDR`` (a port in TIME_WAIT is free;
    one another process listens on is not).

    Raises ``PortUnavailable`` (one line saying what to do) when the port is
    in use, not ours to bind, or the host is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortUnavailable(exc.errno, _bind_problem(host, port, exc)) from None
    except (OverflowError, socket.gaierror) as exc:  # a port out of range, an unknown host
        sock.close()
        raise PortUnavailable(errno.EINVAL, f"cannot listen on {host}:{port}: {exc}") from None
    sock.set_inheritable(True)
    return sock


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    """One line on why ``host:port`` could not be bound, and what to do."""
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} is already in use on {host} (another server, or an earlier "
                f"kvserve, listens there): stop it or give another --port")
    if exc.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied (ports below 1024 need root)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {host} is not an address of this machine (--host)"
    return f"cannot listen on {where}: {exc.strerror or exc}"


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

    ``engine`` is None while the model loads (the server already answers,
    from ``LoadingGate``); the CLI sets it once the engine is ready. A
    SIGTERM or SIGINT before then ends the process at once with status 0
    (``exit_process``): nothing was accepted, and the load runs on a thread
    that cannot be interrupted.

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

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, except that a signal the drain handled is not raised
        again once the server stopped: uvicorn re-raises it for the default
        handler, which under asyncio cancels the CLI's main task and ends
        an idle server's Ctrl-C in a KeyboardInterrupt traceback; the drain
        already shut down cleanly, so the process exits with status 0."""
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.engine is None and sig in (signal.SIGTERM, signal.SIGINT):
            log.info("shutdown_while_loading", signal=signal.Signals(sig).name,
                     message="Stopped while the model was loading: exiting")
            sys.stderr.flush()
            self.exit_process(0)
            return
        if sig not in (signal.SIGTERM, signal.SIGINT) or self._loop is None or self._draining:
            super().handle_exit(sig, frame)
            return
        self._draining = True  # not re-raised after shutdown: we exit 0
        timeout = self.drain_timeout if sig == signal.SIGTERM else 0.0
        name = "sigterm_received" if sig == signal.SIGTERM else "sigint_received"
        log.info(name, drain_timeout_s=timeout)
        self._arm_watchdog(timeout + forced_exit_grace())
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
                          f"(--drain-timeout + {forced_exit_grace():g} s): exiting now")
        sys.stderr.flush()
        self.exit_process(FORCED_EXIT_STATUS)

    def _start_drain(self, timeout: float) -> None:
        asyncio.ensure_future(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        try:
            await self.engine.drain(timeout)
        finally:
            self.should_exit = True
