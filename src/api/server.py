"""The ASGI server: uvicorn, with a graceful drain on SIGTERM.

uvicorn because it is the standard ASGI server for Starlette, runs on uvloop,
and is maintained; a server of our own would add nothing we need.
"""

from __future__ import annotations

import asyncio
import signal
from types import FrameType

import uvicorn
import structlog

log = structlog.get_logger("kvserve.server")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, but SIGTERM first drains the engine.

    On SIGTERM the engine stops admitting (new requests get 503), accepted
    requests run to completion for up to ``drain_timeout`` seconds (the rest
    end with a 503 error event), then uvicorn shuts down and the process exits
    with status 0. SIGINT (Ctrl-C) keeps uvicorn's behaviour.
    """

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self._loop is None:
            super().handle_exit(sig, frame)
            return
        if not self._draining:  # not re-raised after shutdown: we exit 0
            self._draining = True
            log.info("sigterm_received", drain_timeout_s=self.drain_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.engine.drain(self.drain_timeout)
        finally:
            self.should_exit = True
