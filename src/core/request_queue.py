"""Waiting queues of the scheduler: first-come-first-served and priority.

After vLLM v1's ``request_queue.py``: under ``priority`` the lower
``priority`` value is served first, ties broken by arrival time (earlier
first) and then by insertion order. Preempted requests keep their original
arrival time, so they go back ahead of later arrivals of the same priority.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from .request import Request


class RequestQueue(ABC):
    """Ordered collection of waiting requests (by the policy of the subclass).

    Costs: ``add``/``prepend``/``pop`` O(1) (fcfs) or O(log n) (priority),
    ``peek`` amortized O(1), ``remove`` O(k) for k ids, ``len`` and
    ``num_tokens`` O(1). Removal is lazy: the entry stays in the underlying
    deque or heap, marked dead, and is skipped (and dropped) when it reaches
    the front; when dead entries outnumber live ones the structure is
    rebuilt, so memory stays O(live) amortized.
    """

    def __init__(self) -> None:
        # request id -> (entry number, request, tokens counted); an entry of
        # the structure is live iff its number is the one stored here.
        self._live: dict[str, tuple[int, Request, int]] = {}
        self._numbers = itertools.count()
        self._num_tokens = 0
        self._num_dead = 0

    # Subclasses keep entries ``(..., number, request)`` in their structure.
    @abstractmethod
    def _push(self, number: int, request: Request, front: bool) -> None: ...

    @abstractmethod
    def _head(self) -> tuple:
        """The structure's first entry (live or dead); IndexError when empty."""

    @abstractmethod
    def _pop_head(self) -> tuple: ...

    @abstractmethod
    def _entries(self) -> list[tuple]:
        """Every entry (live or dead), in service order."""

    @abstractmethod
    def _rebuild(self, entries: list[tuple]) -> None:
        """Replace the structure with these (live) entries, in service order."""

    def add(self, request: Request) -> None:
        """Queue a new request."""
        self._insert(request, front=False)

    def prepend(self, request: Request) -> None:
        """Re-queue a preempted request at the front of its priority level."""
        self._insert(request, front=True)

    def readd(self, request: Request) -> None:
        """Alias of ``prepend`` (vLLM's name)."""
        self.prepend(request)

    def _insert(self, request: Request, front: bool) -> None:
        if request.request_id in self._live:
            raise ValueError(f"request {request.request_id!r} is already queued")
        number = next(self._numbers)
        tokens = request.num_tokens - request.num_computed_tokens
        self._live[request.request_id] = (number, request, tokens)
        self._num_tokens += tokens
        self._push(number, request, front)

    def _is_live(self, entry: tuple) -> bool:
        held = self._live.get(entry[-1].request_id)
        return held is not None and held[0] == entry[-2]

    def _drop_dead_head(self) -> None:
        while not self._is_live(self._head()):
            self._pop_head()
            self._num_dead -= 1

    def peek(self) -> Request:
        """The next request, without removing it; ``IndexError`` when empty."""
        if not self._live:
            raise IndexError("peek from an empty queue")
        self._drop_dead_head()
        return self._head()[-1]

    def pop(self) -> Request:
        """Remove and return the next request; ``IndexError`` when empty."""
        request = self.peek()
        self._pop_head()
        self._forget(request.request_id)
        return request

    def remove(self, request_ids: Iterable[str]) -> list[Request]:
        """Remove the requests with these ids; returns those that were queued."""
        removed = []
        for request_id in request_ids:
            if request_id in self._live:
                removed.append(self._forget(request_id))
                self._num_dead += 1
        if self._num_dead > max(len(self._live), 32):
            self._rebuild([e for e in self._entries() if self._is_live(e)])
            self._num_dead = 0
        return removed

    def _forget(self, request_id: str) -> Request:
        _, request, tokens = self._live.pop(request_id)
        self._num_tokens -= tokens
        return request

    @property
    def num_tokens(self) -> int:
        """Tokens the queued requests still have to compute (prompt + output,
        as they were when queued: a waiting request computes nothing)."""
        return self._num_tokens

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def __iter__(self) -> Iterator[Request]:
        """Requests in service order (a snapshot; O(n log n) under priority:
        for tests and diagnostics, not for the step loop)."""
        return iter([e[-1] for e in self._entries() if self._is_live(e)])


class FCFSQueue(RequestQueue):
    """First come, first served; preempted requests go to the very front."""

    def __init__(self) -> None:
        super().__init__()
        self._queue: deque[tuple[int, Request]] = deque()

    def _push(self, number: int, request: Request, front: bool) -> None:
        if front:
            self._queue.appendleft((number, request))
        else:
            self._queue.append((number, request))

    def _head(self) -> tuple:
        return self._queue[0]

    def _pop_head(self) -> tuple:
        return self._queue.popleft()

    def _entries(self) -> list[tuple]:
        return list(self._queue)

    def _rebuild(self, entries: list[tuple]) -> None:
        self._queue = deque(entries)


def priority_key(request: Request, aging_seconds: float | None = None) -> tuple[float, float]:
    """Service order under ``priority``: lower first.

    Without aging: ``(priority, arrival_time)``. With aging every ``S``
    seconds, a request's effective priority at time t is
    ``priority - (t - arrival_time) / S`` (one level better per S seconds
    waited). Every request ages at the same rate, so ordering by it at any t
    equals ordering by the time-free key ``priority + arrival_time / S``,
    which a heap can keep.
    """
    if aging_seconds:
        return (request.priority + request.arrival_time / aging_seconds, request.arrival_time)
    return (request.priority, request.arrival_time)


class PriorityQueue(RequestQueue):
    """Heap ordered by ``priority_key`` then insertion number; lower first."""

    def __init__(self, aging_seconds: float | None = None) -> None:
        super().__init__()
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[float, float, int, Request]] = []

    def _push(self, number: int, request: Request, front: bool) -> None:
        # ``front`` needs nothing: keeping the original arrival time puts a
        # preempted request ahead of later arrivals of its priority.
        heapq.heappush(self._heap, (*priority_key(request, self.aging_seconds), number, request))

    def _head(self) -> tuple:
        return self._heap[0]

    def _pop_head(self) -> tuple:
        return heapq.heappop(self._heap)

    def _entries(self) -> list[tuple]:
        return sorted(self._heap, key=lambda e: e[:3])

    def _rebuild(self, entries: list[tuple]) -> None:
        self._heap = list(entries)  # sorted, hence a valid heap


def create_queue(policy: str, aging_seconds: float | None = None) -> RequestQueue:
    """A queue for ``policy`` (``"fcfs"`` or ``"priority"``, the latter with
    optional aging); ``ValueError`` otherwise."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue(aging_seconds)
    raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
