"""Per-request output streams: what the engine hands back to the API."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from kvserve.actors.messages import (
    GenerateRequest,
    RequestFailed,
    RequestOutput,
    StreamEvent,
)


class RequestStream:
    """An async iterator of one request's events, in order.

    Events are a ``RequestAccepted`` first, then ``RequestOutput`` items for
    each of the ``n`` samples (``index`` tells which), or a single
    ``RequestFailed``. Iteration ends after every sample has had an output
    with a ``finish_reason``, or after a ``RequestFailed``.

    Producers call ``put`` (on the event loop); the consumer iterates. The
    queue is unbounded: the detokenizer never blocks on a slow client.
    """

    def __init__(self, request_id: str, n: int = 1) -> None:
        self.request_id = request_id
        self.n = n
        self._queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self._produced = _FinishTracker(n)
        self._consumed = _FinishTracker(n)

    @property
    def all_finished(self) -> bool:
        """True once the producers have delivered the last event."""
        return self._produced.done

    def put(self, event: StreamEvent) -> None:
        """Deliver an event; ignored after the last one."""
        if not self._produced.done:
            self._produced.see(event)
            self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._consumed.done:
            raise StopAsyncIteration
        event = await self._queue.get()
        self._consumed.see(event)
        return event


class _FinishTracker:
    """Which samples of a stream have finished, seen from one side."""

    def __init__(self, n: int) -> None:
        self._unfinished = set(range(n))

    @property
    def done(self) -> bool:
        return not self._unfinished

    def see(self, event: StreamEvent) -> None:
        if isinstance(event, RequestFailed):
            self._unfinished.clear()
        elif isinstance(event, RequestOutput) and event.finish_reason is not None:
            self._unfinished.discard(event.index)


class EngineClient(Protocol):
    """What the API needs from an engine (``kvserve.engine.AsyncEngine``).

    ``generate`` never raises for bad input: refusals arrive on the stream as
    ``RequestFailed``. ``abort`` is idempotent.
    """

    model_name: str
    max_model_len: int

    def is_ready(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> RequestStream: ...

    async def abort(self, request_id: str) -> None: ...
