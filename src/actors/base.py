"""Actor: an asyncio task that owns an inbox queue and does one job."""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from kvserve.actors.messages import Stop


class Actor:
    """Base class: an inbox, a run loop, a stop sentinel and a bound logger.

    Subclasses implement ``handle(message)``. A message that raises is logged
    (``actor_error``) and passed to ``on_error`` so the subclass can fail the
    request it concerned; the actor itself keeps running, so one bad request
    never stops the engine.
    """

    name = "actor"

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[Any] = asyncio.Queue()
        self.log = structlog.get_logger(f"kvserve.{self.name}").bind(actor=self.name)
        self._task: asyncio.Task[None] | None = None

    def send(self, message: Any) -> None:
        """Put a message in the inbox (never blocks; call from the event loop)."""
        self.inbox.put_nowait(message)

    def start(self) -> asyncio.Task[None]:
        """Start the run loop as a task on the running event loop."""
        self._task = asyncio.create_task(self.run(), name=self.name)
        return self._task

    async def stop(self) -> None:
        """Send the stop sentinel and wait for the loop to end."""
        if self._task is not None and not self._task.done():
            self.send(Stop())
            await self._task

    async def run(self) -> None:
        """Handle messages one by one until ``Stop``."""
        while True:
            message = await self.inbox.get()
            if isinstance(message, Stop):
                return
            await self._dispatch(message)

    async def _dispatch(self, message: Any) -> None:
        try:
            await self.handle(message)
        except Exception as exc:  # noqa: BLE001 - an actor must outlive a bad message
            self.log.exception("actor_error", message_type=type(message).__name__)
            self.on_error(message, exc)

    async def handle(self, message: Any) -> None:
        """Process one message. Subclasses override."""
        raise NotImplementedError

    def on_error(self, message: Any, exc: Exception) -> None:
        """Called when ``handle`` raised; default: nothing beyond the log line."""
