"""Actor: an asyncio task that owns an inbox and does one job.

An actor's only doors are typed messages. Its inbox (``Mailbox``) takes the
message types the actor's class lists in ``accepts`` (one union per inbox)
and refuses any other with ``TypeError`` at the sender; its peers are the
mailboxes it was constructed with. So an actor's state is reachable only
through what it is sent, and the engine wires the actors once, by building
every mailbox first and then each actor with its own and its peers'.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

import structlog

from kvserve.actors.messages import Stop


class Mailbox:
    """An actor's inbox as everyone else sees it: ``send`` of the message
    types ``accepts`` (and ``Stop``), delivered in order.

    Raises ``TypeError`` naming the actor and the types it takes when a
    message of another type is sent: a wiring error, caught where it is made.
    """

    def __init__(self, owner: str, accepts: tuple[type, ...]) -> None:
        self.owner = owner
        self.accepts = accepts
        self._queue: asyncio.Queue[Any] = asyncio.Queue()

    def send(self, message: Any) -> None:
        """Queue ``message`` (never blocks; call from the event loop)."""
        if not isinstance(message, (*self.accepts, Stop)):
            names = ", ".join(t.__name__ for t in self.accepts)
            raise TypeError(f"the {self.owner} actor does not take {type(message).__name__} "
                            f"(its inbox takes {names})")
        self._queue.put_nowait(message)

    async def get(self) -> Any:
        """The next message (waits for one)."""
        return await self._queue.get()

    def get_nowait(self) -> Any:
        """The next message; ``asyncio.QueueEmpty`` when there is none."""
        return self._queue.get_nowait()

    def empty(self) -> bool:
        """True when no message waits."""
        return self._queue.empty()


class Actor:
    """Base class: an inbox, a run loop, a stop sentinel and a bound logger.

    Subclasses set ``name`` and ``accepts`` (the message types of their
    inbox) and implement ``handle(message)``. A message that raises is
    logged (``actor_error``) and passed to ``on_error`` so the subclass can
    fail the request it concerned; the actor itself keeps running, so one
    bad request never stops the engine.

    ``inbox``: the mailbox its peers were given (one is made when None).
    """

    name = "actor"
    accepts: ClassVar[tuple[type, ...]] = ()

    def __init__(self, inbox: Mailbox | None = None) -> None:
        self.inbox = inbox if inbox is not None else self.mailbox()
        self.log = structlog.get_logger(f"kvserve.{self.name}").bind(actor=self.name)
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def mailbox(cls) -> Mailbox:
        """A new mailbox for an actor of this class."""
        return Mailbox(cls.name, cls.accepts)

    def send(self, message: Any) -> None:
        """Put a message in the inbox (never blocks; call from the event loop)."""
        self.inbox.send(message)

    def start(self) -> asyncio.Task[None]:
        """Start the run loop as a task on the running event loop."""
        self._task = asyncio.create_task(self.run(), name=self.name)
        return self._task

    @property
    def running(self) -> bool:
        """True while the run loop has not ended."""
        return self._task is not None and not self._task.done()

    async def stop(self) -> None:
        """Send the stop sentinel and wait for the loop to end."""
        if self.running:
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
