"""StreamRegistry: the open client streams, the detokenizer actor's (it alone writes them)."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.actors.messages import RequestFailed, StreamEvent
from kvserve.actors.stream import RequestStream


def child_request_ids(request_id: str, n: int) -> tuple[str, ...]:
    """The engine-internal ids of a request's ``n`` samples: the id itself
    when ``n == 1``, else ``{id}-0`` ... ``{id}-{n-1}``."""
    return (request_id,) if n == 1 else tuple(f"{request_id}-{i}" for i in range(n))


class StreamRegistry:
    """Maps a client request id (the parent id for ``n > 1``) to its stream.

    A stream is removed when it ends or is aborted; events for a removed
    request are dropped, so actors never work for a client that left.
    """

    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._internal: set[str] = set()  # ids the engine core uses for open requests
        #: Called with (request id, its stream) when an entry goes.
        self.on_close: Callable[[str, RequestStream], None] | None = None

    def open(self, request_id: str, n: int) -> RequestStream:
        """Create and register a stream. Raises ``ValueError`` if the id, or
        the internal id of one of its samples, is in use (see ``can_open``)."""
        if not self.can_open(request_id, n):
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, n)
        self._streams[request_id] = stream
        self._internal.update(child_request_ids(request_id, n))
        return stream

    def adopt(self, request_id: str, stream: RequestStream) -> None:
        """Register a stream made elsewhere (the engine's, opened for a
        request it accepted). Raises ``ValueError`` as ``open``."""
        if not self.can_open(request_id, stream.n):
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = stream
        self._internal.update(child_request_ids(request_id, stream.n))

    def can_open(self, request_id: str, n: int) -> bool:
        """False when ``request_id`` or any internal id its ``n`` samples would
        use is held by an open request (client ids ``job`` with n=2 and
        ``job-0`` must never meet inside the engine)."""
        ids = {request_id, *child_request_ids(request_id, n)}
        return not (ids & self._internal or ids & self._streams.keys())

    def is_open(self, request_id: str) -> bool:
        """True while the client still waits for this request."""
        return request_id in self._streams

    def get(self, request_id: str) -> RequestStream | None:
        """The open stream of a request, or None."""
        return self._streams.get(request_id)

    def num_samples(self, request_id: str) -> int:
        """``n`` of an open request (1 if unknown)."""
        stream = self._streams.get(request_id)
        return stream.n if stream is not None else 1

    def put(self, request_id: str, event: StreamEvent) -> None:
        """Deliver an event; close the entry once the stream has ended."""
        stream = self._streams.get(request_id)
        if stream is None:
            return
        stream.put(event)
        if stream.all_finished:
            self.close(request_id)

    def fail(self, event: RequestFailed) -> None:
        """Deliver a terminal failure."""
        self.put(event.request_id, event)

    def close(self, request_id: str) -> RequestStream | None:
        """Forget a stream (finished or aborted); returns it if it was open."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return None
        self._internal.difference_update(child_request_ids(request_id, stream.n))
        if self.on_close is not None:
            self.on_close(request_id, stream)
        return stream

    def __len__(self) -> int:
        return len(self._streams)

    def ids(self) -> list[str]:
        """Ids of the open streams."""
        return list(self._streams)
